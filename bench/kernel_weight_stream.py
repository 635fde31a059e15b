"""How close a TMA ring in shared memory brings a batch-1 Ouro loop to the copy floor: the structure probe
`bench/weight_stream_kernel.py` (every weight of 24 layers streamed by one persistent Gluon launch, grid
barriers between the GEMV stages) against the copy floor and against cuBLAS per GEMV, in one process.

    python bench/kernel_weight_stream.py --out DIR [--layers 24] [--shapes 16:12:4,32:6:4] [--rounds 5]
        [--check-layers 3] [--compile-only]

A shape is BN:SLOTS:WARPS (rows per item, ring slots of BN x 256 bf16, warps). Arms, interleaved per round:
  stream BN:SLOTS:WARPS      the probe with its grid barriers (correct results)
  stream, no barriers        the first shape without them: the stream alone (results not meaningful)
  cuBLAS per GEMV, graph     the same skeleton as torch ops (bf16 GEMV per stage), one CUDA graph per loop
Checks (first --check-layers layers): each shape against float64 (relative error of the final residual),
two launches bit for bit, and no grid barrier gave up. `--compile-only` compiles each shape for sm_90a on
any machine (no GPU) and reports registers, spills and shared memory. Writes DIR/weight_stream.md and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # looptrace, where it is not installed

import weight_stream_kernel as wsk  # noqa: E402
from gluon_compile import compile_sm90, tile_descriptor  # noqa: E402
from kernel_persistent_loop import copy_floor_gbs  # noqa: E402

HIDDEN, INTER, NQKV, BK, XROWS = 2048, 5632, 3 * 2048, 256, 32


def tile_layout():
    import triton.experimental.gluon.language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def constexprs(bn: int, slots: int, warps: int, barriers: bool = True) -> dict:
    return dict(
        H=HIDDEN,
        NQKV=NQKV,
        INTER=INTER,
        BN=bn,
        BK=BK,
        SLOTS=slots,
        XROWS=XROWS,
        BARRIERS=barriers,
        WARPS=warps,
    )


def compile_only(bn: int, slots: int, warps: int) -> dict:
    """Compile one shape for sm_90a with Triton's own ptxas: no GPU needed."""
    fn = wsk.weight_stream_kernel
    cx = constexprs(bn, slots, warps)
    signature = {}
    for name in fn.arg_names:
        if name in cx:
            signature[name] = "constexpr"
        elif name.startswith("d_"):
            signature[name] = tile_descriptor(bn, BK)
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name == "bar_ptr" else "*fp32"
        else:
            signature[name] = "i32"
    return dict(shape=f"{bn}:{slots}:{warps}", **compile_sm90(fn, signature, cx, warps))


class Skeleton:
    """The weights (seeded, bf16, the real shapes), the activation buffers and the launch of one shape."""

    def __init__(self, layers: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(layers * rows, cols, generator=g, device="cuda") / cols**0.5).to(
                torch.bfloat16
            )

        self.layers = layers
        self.qkv, self.o = weight(NQKV, HIDDEN), weight(HIDDEN, HIDDEN)
        self.gate_up, self.down = weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER)
        self.h = torch.randn(HIDDEN, generator=g, device="cuda")
        self.outs = [torch.zeros(n, device="cuda") for n in (NQKV, HIDDEN, 2 * INTER, HIDDEN)]
        self.out = torch.zeros(HIDDEN, device="cuda")
        self.bar = torch.zeros(3, dtype=torch.int32, device="cuda")  # arrivals, -, waits that gave up
        self.programs = torch.cuda.get_device_properties(0).multi_processor_count

    def weight_bytes(self, layers: int) -> int:
        per_layer = sum(w.numel() for w in (self.qkv, self.o, self.gate_up, self.down)) * 2 // self.layers
        return per_layer * layers

    def launch(self, bn: int, slots: int, warps: int, layers: int, barriers: bool = True):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        key = (bn, slots, warps)
        if getattr(self, "_descs", {}).get("key") != key:
            layout = tile_layout()
            self._descs = dict(
                key=key,
                descs=[
                    TensorDescriptor.from_tensor(w, [bn, BK], layout)
                    for w in (self.qkv, self.o, self.gate_up, self.down)
                ],
            )
        self.bar.zero_()
        wsk.weight_stream_kernel[(self.programs,)](
            *self._descs["descs"],
            self.h,
            *self.outs,
            self.out,
            self.bar,
            layers,
            **constexprs(bn, slots, warps, barriers),
            num_warps=warps,
        )
        return self.out

    def reference(self, layers: int, dtype=torch.float64) -> torch.Tensor:
        """The same skeleton in torch: float64 for the check, or bf16 GEMVs (cuBLAS) for the timing arm."""
        h = self.h.to(dtype)
        for layer in range(layers):
            qkv = self.qkv[layer * NQKV : (layer + 1) * NQKV].to(dtype) @ h.to(dtype)
            h = h + self.o[layer * HIDDEN : (layer + 1) * HIDDEN].to(dtype) @ qkv[:HIDDEN].to(dtype)
            gu = self.gate_up[layer * 2 * INTER : (layer + 1) * 2 * INTER].to(dtype) @ h.to(dtype)
            act = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
            h = h + self.down[layer * HIDDEN : (layer + 1) * HIDDEN].to(dtype) @ act.to(dtype)
        return h


def cublas_loop(sk: Skeleton, layers: int):
    """The skeleton as bf16 torch ops (one cuBLAS GEMV per stage), captured in one CUDA graph."""
    h = sk.h.to(torch.bfloat16)
    weights = [
        (w, rows) for w, rows in ((sk.qkv, NQKV), (sk.o, HIDDEN), (sk.gate_up, 2 * INTER), (sk.down, HIDDEN))
    ]

    def body():
        x = h
        for layer in range(layers):
            (wq, nq), (wo, no), (wg, ng), (wd, nd) = weights
            qkv = wq[layer * nq : (layer + 1) * nq] @ x
            x = x + wo[layer * no : (layer + 1) * no] @ qkv[:HIDDEN]
            gu = wg[layer * ng : (layer + 1) * ng] @ x
            x = x + wd[layer * nd : (layer + 1) * nd] @ (torch.nn.functional.silu(gu[:INTER]) * gu[INTER:])
        return x

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


def time_ms(fn, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


SHARED_LIMIT = 227 * 1024  # bytes of shared memory one Hopper CTA may hold


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_shapes(spec: str) -> list[tuple[int, int, int]]:
    """BN:SLOTS:WARPS entries; each must fit one SM's shared memory with x beside the ring."""
    shapes = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            fail(f"--shapes entry {item!r}: expected BN:SLOTS:WARPS, e.g. 16:12:4")
        bn, slots, warps = (int(p) for p in parts)
        if bn not in (8, 16, 32, 64) or warps not in (4, 8) or slots < 2:
            fail(f"--shapes entry {item!r}: expected BN in 8/16/32/64, SLOTS >= 2, WARPS 4 or 8")
        shared = slots * bn * BK * 2 + XROWS * BK * 4
        if shared > SHARED_LIMIT:
            fail(f"--shapes entry {item!r}: {shared} bytes of shared memory, more than {SHARED_LIMIT}")
        shapes.append((bn, slots, warps))
    return shapes


def write(out: Path, report: dict, lines: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_stream.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "weight_stream.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--shapes", default="16:12:4,32:6:4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check-layers", type=int, default=3)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes)
    command = "python bench/kernel_weight_stream.py " + " ".join(sys.argv[1:])
    versions = dict(torch=torch.__version__, triton=triton.__version__)

    if args.compile_only:
        rows = [compile_only(*shape) for shape in shapes]
        lines = [
            f"`{command}` (sm_90a, compiled on the CPU; {versions})",
            "",
            "| BN:SLOTS:WARPS | registers | spill bytes | shared bytes |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['shape']} | {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} |" for r in rows
        ]
        write(args.out, dict(command=command, versions=versions, compiled=rows), lines)
        return 0

    if not torch.cuda.is_available():
        print("bench/kernel_weight_stream.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    floor = copy_floor_gbs()
    sk = Skeleton(args.layers)
    floor_ms = sk.weight_bytes(args.layers) / floor / 1e6
    print(
        f"{device}: copy {floor:.0f} GB/s, weights per loop {sk.weight_bytes(args.layers) / 1e9:.3f} GB, "
        f"floor {floor_ms:.3f} ms",
        flush=True,
    )

    checks = {}
    expected = sk.reference(args.check_layers)
    for shape in shapes:
        first = sk.launch(*shape, args.check_layers).clone()
        gave_up = int(sk.bar[2])
        second = sk.launch(*shape, args.check_layers).clone()
        err = float((first.double() - expected).norm() / expected.norm())
        checks[":".join(map(str, shape))] = dict(
            rel_err_vs_float64=err, repeat_bitwise=bool(torch.equal(first, second)), barriers_gave_up=gave_up
        )
        print(f"check {shape}: {checks[':'.join(map(str, shape))]}", flush=True)
    bf16_err = float(
        (sk.reference(args.check_layers, torch.bfloat16).double() - expected).norm() / expected.norm()
    )

    arms = {
        f"stream {bn}:{slots}:{warps}": (lambda s=(bn, slots, warps): sk.launch(*s, args.layers))
        for bn, slots, warps in shapes
    }
    arms["stream, no barriers"] = lambda: sk.launch(*shapes[0], args.layers, barriers=False)
    arms["cuBLAS per GEMV, graph"] = cublas_loop(sk, args.layers)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for fn in arms.values():  # compile and warm
        fn()
    torch.cuda.synchronize()
    interrupted = False
    try:
        for _ in range(args.rounds):
            for name, fn in arms.items():
                times[name].append(time_ms(fn))
    except KeyboardInterrupt:
        interrupted = True
    rows = {name: statistics.median(t) for name, t in times.items() if t}
    lines = [
        f"`{command}`",
        "",
        f"{device}; {versions}; copy {floor:.0f} GB/s measured in the same process; "
        f"{args.layers} layers read {sk.weight_bytes(args.layers) / 1e9:.3f} GB -> floor {floor_ms:.3f} ms",
        "",
        "| arm | ms per loop (median of rounds) | x floor | % of copy bandwidth |",
        "|---|---|---|---|",
    ]
    for name, ms in rows.items():
        lines.append(f"| {name} | {ms:.3f} | {ms / floor_ms:.2f} | {100 * floor_ms / ms:.0f} |")
    lines += [
        "",
        f"Checks over {args.check_layers} layers (bf16 torch ops: {bf16_err:.2e} from float64):",
        "",
    ]
    lines += [f"- {shape}: {c}" for shape, c in checks.items()]
    if interrupted:
        lines.append("\nInterrupted: medians of the rounds that finished.")
    write(
        args.out,
        dict(
            command=command,
            device=device,
            versions=versions,
            copy_gbs=floor,
            floor_ms=floor_ms,
            ms=rows,
            rounds=times,
            checks=checks,
            bf16_torch_rel_err=bf16_err,
        ),
        lines,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
