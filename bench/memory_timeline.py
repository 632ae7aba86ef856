"""The memory timeline of Llama-3-8B's full stack at 5M tokens on 8x H100: what it costs, where its peak is, and
torch's viewer drawing it in headless Chromium.

    .venv/bin/python bench/memory_timeline.py | tee bench/results/memory_timeline.txt
    .venv/bin/python bench/memory_timeline.py --viewer DIR     # a machine without internet: the viewer's files

1. ``autotune estimate`` of the config with and without ``--memory-timeline`` (``--memory-snapshot`` too), each a
   fresh process with the plan store off (``AUTOTUNE_PLAN_CACHE=off``): both trace the step; with the timeline
   the prediction's own first trace records it. The ratio is the figure (goal: at most 1.5).
2. The snapshot's peak, replayed (the largest sum of live sizes), against the traced copy's tensor peak in the
   timeline's title, and what is live at that moment by category, by technique and by module.
3. The page in headless Chromium (Debian's ``chromium``): served on 127.0.0.1, a screenshot of the active memory
   timeline into docs/gallery/memory-timeline.png, and the console's errors (there must be none).
   torch's page loads the viewer (``MemoryViz.js``, at the installed torch's tag) and d3 5 from CDNs; with ``--viewer
   DIR`` an import map in the served copy points those URLs at DIR/MemoryViz.js and DIR/node_modules (``npm
   install d3@5`` there), for a machine that reaches no CDN. The page itself is unchanged.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trials.trial.memory_timeline import VIEWER_URL, replay_peak, snapshots_in_html, viewer_ref  # noqa: E402

GOAL_RATIO = 1.5
SCREENSHOT = ROOT / "docs" / "gallery" / "memory-timeline.png"
# the full stack, every knob on (the main job's longest front config), at 5M tokens on one 8x H100 node
CONFIG = {
    "schema": "autotune/config-v1",
    "model": "llama3-8b",
    "hardware": "h100-sxm",
    "gpus": 8,
    "seq_len": 5 * 1024**2,
    "techniques": {
        "fsdp": True,
        "optimizer_offload": True,
        "ulysses_degree": 8,
        "head_chunk": 1,
        "activation_checkpointing": True,
        "activation_offload_layers": 32,
        "mlp_tile_tokens": 16384,
        "loss_tile_tokens": 2048,
        "norm_tile_tokens": 65536,
        "attention": "flash3",
    },
}
CDN_VIEWER = VIEWER_URL.format(ref=viewer_ref())  # the URL the page loads its viewer from
CDN_D3 = {  # MemoryViz.js's imports -> the npm package that serves each
    "https://cdn.skypack.dev/d3@5": "d3",
    "https://cdn.skypack.dev/d3-axis@1": "d3-axis",
    "https://cdn.skypack.dev/d3-scale@1": "d3-scale",
    "https://cdn.skypack.dev/d3-zoom@1": "d3-zoom",
    "https://cdn.skypack.dev/d3-brush@1": "d3-brush",
}
GIB = 2**30


def estimate(config: Path, extra: list[str]) -> tuple[float, dict, str]:
    """One ``autotune estimate --json`` in a fresh process: (seconds, record, stderr)."""
    env = {**os.environ, "AUTOTUNE_PLAN_CACHE": "off", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "autotune.cli", "estimate", "--config", str(config), "--json", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"estimate failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds, json.loads(done.stdout), done.stderr


def live_at_peak(snapshot: dict) -> list[dict]:
    """The allocations live when the replayed trace peaks (each as {frame kind: value, "size": bytes})."""
    live: dict[int, dict] = {}
    best, best_live, total = -1, {}, 0
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = dict({f["filename"]: f["name"] for f in event["frames"]}, size=event["size"])
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif event["action"] == "free_completed":
            total -= live.pop(event["addr"])["size"]
    return list(best_live.values())


def breakdown(allocations: list[dict], key: str, top: int = 6) -> list[str]:
    sums: Counter = Counter()
    for allocation in allocations:
        sums[allocation.get(key, "?")] += allocation["size"]
    return [f"    {size / GIB:7.2f} GiB  {name}" for name, size in sums.most_common(top)]


def import_map(viewer: Path) -> str:
    """An import map sending the viewer's CDN URLs to ``viewer``'s MemoryViz.js and node_modules (npm's d3 5)."""
    modules = viewer / "node_modules"
    imports = {CDN_VIEWER: "/viewer/MemoryViz.js"}
    for package in sorted(p for p in modules.iterdir() if (p / "package.json").is_file()):
        meta = json.loads((package / "package.json").read_text())
        entry = meta.get("module") or meta.get("jsnext:main")
        if entry:
            imports[package.name] = f"/viewer/node_modules/{package.name}/{entry}"
            imports[f"{package.name}/"] = f"/viewer/node_modules/{package.name}/"
    for url, package in CDN_D3.items():
        imports[url] = imports[package]
    return f'<script type="importmap">{json.dumps({"imports": imports})}</script>'


# Collects what the page's console and loader report (errors thrown, promises rejected, console.error, resources
# that failed to load) into a hidden element that ``--dump-dom`` shows: headless Chromium keeps its console to itself.
CONSOLE_PROBE = """<script>
const consoleErrors = [];
function reportError(text) {
  consoleErrors.push(text);
  let list = document.getElementById('console-errors');
  if (!list) { list = document.createElement('pre'); list.id = 'console-errors'; list.hidden = true;
               document.documentElement.appendChild(list); }
  list.textContent = consoleErrors.join('\\n');
}
window.addEventListener('error', e => reportError(e.message ? `${e.message} (${e.filename}:${e.lineno})`
  : `could not load ${e.target && (e.target.src || e.target.href || e.target.tagName)}`), true);
window.addEventListener('unhandledrejection', e => reportError(`unhandled rejection: ${e.reason}`));
const consoleError = console.error;
console.error = (...args) => { reportError(args.join(' ')); consoleError(...args); };
</script>
"""


def render(page: str, viewer: Path | None, screenshot: Path) -> tuple[list[str], int]:
    """The page in headless Chromium: (the console's errors, the timeline's polygons drawn), and a screenshot."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return ["no chromium on this machine (Debian: apt-get install chromium)"], 0
    served = page.replace("<head>", "<head>\n" + CONSOLE_PROBE, 1)
    if viewer is not None:
        served = served.replace('<script type="module">', import_map(viewer) + '\n<script type="module">', 1)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp)
        if viewer is not None:
            (site / "viewer").symlink_to(viewer.resolve())
        (site / "timeline.html").write_text(served)
        handler = functools.partial(_QuietHandler, directory=str(site))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/timeline.html"
        browser = [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars"]
        browser += ["--window-size=1400,900", "--virtual-time-budget=30000"]
        try:
            dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=300).stdout
            shot = subprocess.run([*browser, f"--screenshot={screenshot}", url], capture_output=True, timeout=300)
        finally:
            server.shutdown()
    found = re.search(r'<pre id="console-errors"[^>]*>(.*?)</pre>', dom, re.S)
    errors = [line for line in (found.group(1).splitlines() if found else []) if line.strip()]
    if not screenshot.is_file():
        errors.append(f"no screenshot (chromium exit {shot.returncode})")
    return errors, dom.count("<polygon")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site; an ES module path without its ``.js`` (d3 5's sources import "./selection/on") resolves to
    the file, as a bundler resolves it."""

    def translate_path(self, path: str) -> str:
        local = super().translate_path(path)
        if not os.path.exists(local):
            for candidate in (local + ".js", os.path.join(local, "index.js")):
                if os.path.isfile(candidate):
                    return candidate
        return local

    def guess_type(self, path) -> str:
        return "text/javascript" if str(path).endswith(".js") else super().guess_type(path)

    def log_message(self, *args) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--viewer", type=Path, help="a folder with MemoryViz.js and node_modules/ (npm install d3@5)")
    parser.add_argument("--screenshot", type=Path, default=SCREENSHOT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "full-stack-5M.json"
        config.write_text(json.dumps(CONFIG))
        html, pickle_path = Path(tmp) / "t.html", Path(tmp) / "t.pickle"
        without_s, record, _ = estimate(config, [])
        with_s, record_with, stderr = estimate(
            config, ["--memory-timeline", str(html), "--memory-snapshot", str(pickle_path)]
        )
        page = html.read_text()
        (snapshot,) = snapshots_in_html(page)
        title = re.search(r"<title>(.*)</title>", page).group(1)
        html_mib, pickle_mib = html.stat().st_size / 2**20, pickle_path.stat().st_size / 2**20
        errors, polygons = render(page, args.viewer, args.screenshot)
    techniques = ", ".join(f"{k}={v}" for k, v in CONFIG["techniques"].items())
    print(f"config: llama3-8b, 5,242,880 tokens, 8x h100-sxm; {techniques}")
    print(f"estimate: {record['status']}, peak {record['peak_device_bytes'] / GIB:.2f} GiB (full depth, overheads in)")
    print(f"timeline: {title}")
    events = snapshot["device_traces"][0]
    allocations = sum(1 for e in events if e["action"] == "alloc")
    print(
        f"  {allocations:,} allocations in {len(events):,} events; page {html_mib:.1f} MiB, snapshot {pickle_mib:.1f} MiB"
    )
    peak = replay_peak(snapshot)
    print(f"  replayed peak {peak:,} bytes ({peak / GIB:.2f} GiB), the traced copy's tensor peak")
    live = live_at_peak(snapshot)
    for key in ("category", "technique", "module"):
        print(f"  live at the peak by {key}:")
        print("\n".join(breakdown(live, key)))
    print(
        f"chromium: {len(errors)} console errors, {polygons:,} polygons drawn; screenshot "
        f"{args.screenshot.relative_to(ROOT) if args.screenshot.is_relative_to(ROOT) else args.screenshot}"
    )
    for line in errors:
        print(f"  {line}")
    assert record_with["peak_device_bytes"] == record["peak_device_bytes"], "the timeline changed the estimate"
    ratio = with_s / without_s
    print(
        f"estimate without the timeline {without_s:.1f} s, with it {with_s:.1f} s: "
        f"ratio {ratio:.2f} (goal <= {GOAL_RATIO})"
    )
    return 0 if not errors and polygons and ratio <= GOAL_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
