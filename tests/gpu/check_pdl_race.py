"""Whether the back-to-back check of ``bench kernels --verify`` can fail: the same check, with the GEMMs
launched with PDL but their wait for the act-quant's codes removed (sm_90 only; CUDA only).

    python tests/gpu/check_pdl_race.py --out race.json

Runs the check twice, in two processes (Triton compiles each kernel once per process), both with the act-quant
letting the GEMM start as its first instruction (``TRIGGER_FIRST``: the widest overlap; LowBit lets it start
after its last store): with the GEMMs' wait, and with ``wait_for_inputs`` replaced by a call that does not wait.
The first must pass everywhere; the second is expected to fail where a GEMM reads the codes before the
act-quant has written them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def _run(mode: str) -> list:
    import torch

    from lowbit.kernels import gdc, triton_act_quant, triton_act_quant_split, triton_w4_gemm, triton_w8a8_gemm
    from lowbit.kernels.gpu_checks import _check_back_to_back

    first = lambda device: gdc.TRIGGER_FIRST if gdc.pdl_launch(device) else gdc.NO_TRIGGER  # noqa: E731
    triton_act_quant.trigger_point = triton_act_quant_split.trigger_point = first
    if mode == "nowait":  # before the first compile: the kernels resolve the name when they are compiled
        triton_w8a8_gemm.wait_for_inputs = gdc.let_dependents_start
        triton_w4_gemm.wait_for_inputs = gdc.let_dependents_start
    device = torch.device("cuda")
    results = []
    _check_back_to_back(device, torch.cuda.get_device_capability(device),
                        lambda name, ok, detail="": results.append({"check": name, "ok": bool(ok)}))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("wait", "nowait"), help=argparse.SUPPRESS)  # one child process
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("check_pdl_race: needs a CUDA GPU (sm_90 or newer)", file=sys.stderr)
        return 2
    if args.mode:
        json.dump(_run(args.mode), open(args.out, "w"), indent=1)
        return 0
    report = {}
    for mode in ("wait", "nowait"):
        subprocess.run([sys.executable, __file__, "--mode", mode, "--out", f"{args.out}.{mode}"], check=True)
        report[mode] = json.load(open(f"{args.out}.{mode}"))
        passed = sum(r["ok"] for r in report[mode])
        print(f"{mode}: {passed} of {len(report[mode])} checks passed", flush=True)
    json.dump(report, open(args.out, "w"), indent=1)
    return 0 if all(r["ok"] for r in report["wait"]) else 1


if __name__ == "__main__":
    sys.exit(main())
