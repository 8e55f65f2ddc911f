"""PNG plots of the benchmark results (training, peers, decoding, scaling) for docs/benchmarks/."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> str:
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)


def training(results: dict, path: Path):
  trains = [(k, v) for k, v in results.items() if k.startswith("train_") and "jax" in v]
  if not trains:
    return None
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  width = 0.25
  for i, (_, t) in enumerate(trains):
    bars = [("ours (trainer's step)", t["jax"]["baseline"].get("target_tokens_per_s"), "tab:blue"),
            ("unoptimized (ablation)", t["jax"].get("unoptimized", {}).get("target_tokens_per_s"), "tab:gray")]
    for j, (label, value, color) in enumerate(bars):
      if value:
        axes[0].bar(i + (j - 1) * width, value, width, color=color, label=label if i == 0 else None)
    machine = results.get("machine", {}).get("matmul", {}).get("2048", {}).get("median_flops")

    def mfu(name, entry):  # the table's "MFU vs (1)": FLOP/s at the median step / section 1's 2048² rate
      if machine and entry.get("model_flops_per_s"):
        return entry["model_flops_per_s"] / machine
      return entry.get("mfu_vs_matmul")
    for j, (label, value, color) in enumerate(
        [("ours (trainer's step)", mfu("baseline", t["jax"]["baseline"]), "tab:blue"),
         ("unoptimized (ablation)", mfu("unoptimized", t["jax"].get("unoptimized", {})), "tab:gray")]):
      if value:
        axes[1].bar(i + (j - 1) * width, 100 * value, width, color=color, label=label if i == 0 else None)
  names = [t["preset"] for _, t in trains]
  for ax, title in ((axes[0], "real target tokens/s (same rounds)"),
                    (axes[1], "model FLOP/s as % of the 2048² matmul rate of (1)")):
    ax.set_xticks(range(len(names)), names)
    ax.set_title(title)
    ax.legend(fontsize=8)
  for goal, preset in ((60, "base"), (40, "tiny")):
    if preset in names:
      k = names.index(preset)
      axes[1].hlines(goal, k - 0.45, k + 0.45, colors="k", linestyles="--")
  axes[0].set_yscale("log")
  # Ablations: what each library speed-up buys (variant step time / library step time), per preset.
  variants = []
  for _, t in trains:
    variants += [n for n in t["jax"] if n != "baseline" and n not in variants]
  w = 0.8 / max(len(trains), 1)
  for i, (_, t) in enumerate(trains):
    xs = [k + i * w for k, n in enumerate(variants) if n in t["jax"]]
    ys = [1.0 / t["jax"][n]["speedup_vs_baseline"] for n in variants if n in t["jax"]]
    axes[2].bar(xs, ys, w, label=t["preset"])
  axes[2].axhline(1.0, color="k", lw=0.8)
  axes[2].set_xticks([k + w * (len(trains) - 1) / 2 for k in range(len(variants))], variants, rotation=20,
                     fontsize=8)
  axes[2].set_title("library speed-up over each ablation (>1: the library is faster)", fontsize=9)
  axes[2].legend(fontsize=8)
  return _save(fig, path)


PEER_COLORS = {"ours": "tab:blue", "flax": "tab:green", "torch": "tab:orange"}


def peers(results: dict, path: Path):
  """Real target tokens/s of every framework, packed and plain batches, one panel per preset."""
  sections = [v for k, v in results.items() if k.startswith("peers_") and "kinds" in v]
  if not sections:
    return None
  fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 4.2), squeeze=False)
  for ax, p in zip(axes[0], sections):
    kinds = list(p["kinds"])
    frameworks = [fw for fw in ("ours", "flax", "torch") if any(fw in p["kinds"][k] for k in kinds)]
    width = 0.8 / max(len(frameworks), 1)
    for j, fw in enumerate(frameworks):
      values = [p["kinds"][k].get(fw, {}).get("target_tokens_per_s", 0) for k in kinds]
      ax.bar([i + (j - (len(frameworks) - 1) / 2) * width for i in range(len(kinds))], values, width,
             color=PEER_COLORS.get(fw), label=fw)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_title(f"{p['preset']}: real target tokens/s, each framework in its own process", fontsize=9)
    ax.legend(fontsize=8)
  return _save(fig, path)


def decoding(results: dict, path: Path):
  d = results.get("decode", {})
  if "beam4" not in d:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  n = d["sources"]
  labels, values, colors = [], [], []
  for key in ("greedy", "beam4"):
    labels += [f"{key}\ncached", f"{key}\nuncached*"]
    values += [d[key]["sentences_per_s"], n / d["cache"][key]["file_uncached_s_extrapolated"]]
    colors += ["tab:blue", "tab:gray"]
  labels.append("encoder\nalone")
  values.append(d["encoder"]["sentences_per_s"])
  colors.append("tab:green")
  axes[0].bar(labels, values, color=colors)
  axes[0].set_yscale("log")
  axes[0].set_title(f"sentences/s, {n} sources (*uncached extrapolated from a subset)", fontsize=9)
  c = d["cache"]
  keys = ("greedy", "beam4")
  x = range(len(keys))
  axes[1].bar(list(x), [c[k]["speedup"] for k in keys], 0.5, label="cached / uncached")
  axes[1].axhline(5, color="k", ls="--", lw=0.8)
  axes[1].set_xticks(list(x), keys)
  axes[1].set_title(f"speedups, {c['output_len']}-token outputs, {c['subset_sources']} sources", fontsize=9)
  axes[1].legend(fontsize=8)
  return _save(fig, path)


def scaling(results: dict, path: Path):
  s = results.get("scaling", {})
  if "points" not in s:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  pts = [p for p in s["points"] if p["kind"] == "length"]
  L = [p["row_length"] for p in pts]
  axes[0].plot(L, [p["step_s_rel"] for p in pts], "o-", label="measured step time")
  axes[0].plot(L, [p["flops_rel"] for p in pts], "s--", label="analytic FLOPs")
  ax2 = axes[0].twinx()
  ax2.bar(L, [100 * p["attention_share_flops"] for p in pts], width=[0.3 * x for x in L], alpha=0.25,
          color="tab:red")
  ax2.set_ylabel("attention share of FLOPs (%)", color="tab:red")
  axes[0].set_xscale("log", base=2)
  axes[0].set_xlabel("row length (tokens/batch fixed)")
  axes[0].set_ylabel(f"relative to L={L[0]}")
  axes[0].legend(fontsize=8, loc="upper left")
  axes[0].set_title(f"{s['preset']} preset: O(n²) attention")
  row = pts[0]["row_length"]
  tok = sorted([p for p in s["points"] if p["row_length"] == row], key=lambda p: p["tokens_per_batch"])
  axes[1].plot([p["tokens_per_batch"] for p in tok], [p["target_tokens_per_s"] for p in tok], "o-")
  axes[1].set_xscale("log", base=2)
  axes[1].set_xlabel(f"tokens per batch (row length {row})")
  axes[1].set_ylabel("real target tokens/s")
  axes[1].set_title("batch size")
  return _save(fig, path)


def long_inputs(results: dict, path: Path):
  """Step time and peak RSS against length, one line per attention mode; the memory limit dashed."""
  s = results.get("long_inputs", {})
  if "points" not in s:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for mode in s["longest_fitting"]:
    pts = [p for p in s["points"] if p["mode"] == mode and p.get("step_s")]
    lengths = [p["length"] for p in pts]
    axes[0].plot(lengths, [p["step_s"] for p in pts], "o-", label=mode)
    axes[1].plot(lengths, [p["peak_rss_gib"] for p in pts], "o-", label=mode)
  axes[1].axhline(s["memory_limit_gib"], color="gray", linestyle="--", label=f"{s['memory_limit_gib']:g} GiB")
  for ax, label in ((axes[0], "training step (s)"), (axes[1], "peak RSS (GiB)")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per row (source = target length, batch of one)")
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
  axes[0].set_title(f"{s['preset']} preset: step time vs length")
  axes[1].set_title("peak memory vs length")
  return _save(fig, path)


def write_all(results: dict, directory: Path) -> list[str]:
  directory = Path(directory)
  written = [training(results, directory / "training.png"), peers(results, directory / "peers.png"),
             decoding(results, directory / "decoding.png"), scaling(results, directory / "scaling.png"),
             long_inputs(results, directory / "long_inputs.png")]
  return [p for p in written if p]
