"""The plan-as-code workflow with the real `tpplan` command line: infer, edit, check, diff,
verify, and a broken edit that `check` refuses. README.md beside this file walks through the
same steps by hand.

Run it as a plain script: `python examples/plan_as_code/workflow.py [DIR]`. It writes the plan
files to DIR (a temporary folder when none is given), prints every command with its output,
and exits non-zero if a command's exit code is not the one the step expects. GPT-2 (124M) is
built on the meta device for infer and check (no weights, no download); verify builds a 2-layer
GPT-2 with random weights on the CPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def tpplan(*args: str, expect: int) -> str:
    """Run `tpplan ARGS...` as a person would in a shell; return its output."""
    # The script next to this interpreter first: it is the one installed with this tpplan.
    exe = shutil.which("tpplan", path=str(Path(sys.executable).parent)) or shutil.which("tpplan")
    if exe is None:
        raise SystemExit("the `tpplan` command is not on PATH; install tpplan (pip install .)")
    print(f"$ tpplan {' '.join(args)}", flush=True)
    run = subprocess.run([exe, *args], capture_output=True, text=True)
    output = run.stdout + run.stderr
    print(output.rstrip() + f"\n(exit {run.returncode})\n", flush=True)
    if run.returncode != expect:
        raise SystemExit(f"`tpplan {args[0]}` exited {run.returncode}, expected {expect}")
    return output


def replace_rule(text: str, match: str, new: str) -> str:
    """Retype one rule: its comment block (its `why`) and its keys, as an editor would."""
    rule = re.compile(rf"(?:  #[^\n]*\n)*  - match: {re.escape(match)}\n(?:    [^\n]*\n)*")
    found = rule.findall(text)
    if len(found) != 1:
        raise SystemExit(f"expected one rule `match: {match}` in the plan, found {len(found)}")
    return rule.sub(new, text)


def main(folder: Path) -> None:
    plan = folder / "gpt2.yaml"

    # 1. infer: the plan for GPT-2 at tp 2, one rule per layer pattern, each with its reason.
    tpplan("infer", "gpt2", "--tp", "2", "-o", str(plan), expect=0)

    # 2. edit: keep the MLP whole on every rank (say, to measure attention's split alone). Both
    # of its layers change together: c_fc opens the split region that c_proj closes.
    text = plan.read_text()
    for layer in ("c_fc", "c_proj"):
        text = replace_rule(
            text,
            f"transformer.h.*.mlp.{layer}",
            f"  # kept whole: the MLP stays unsplit while attention's split is measured alone\n"
            f"  - match: transformer.h.*.mlp.{layer}\n"
            f"    style: replicate\n",
        )
    # The fingerprint ties the plan to the exact 12-layer model; verify runs a 2-layer copy.
    text = re.sub(r"(?m)^  fingerprint: .*\n", "", text)
    plan.write_text(text)

    # 3. check: the edited plan against the model it is for, at the tp size it will run at.
    # This is the step the pre-commit hook runs (.pre-commit-config.yaml beside this file).
    out = tpplan("check", str(plan), "gpt2", "--tp", "2", expect=0)
    if "sound at tp 2" not in out:
        raise SystemExit("check exited 0 without saying the plan is sound")

    # 4. diff: what the edit changed against the inferred plan, for review (exit 1: differs).
    out = tpplan("diff", str(plan), "gpt2", "--tp", "2", expect=1)
    if "mlp.c_fc" not in out:
        raise SystemExit("diff did not name the edited layers")

    # 5. verify: the sharded model against the unsharded one, forward and backward, on a
    # 2-layer GPT-2 (the plan names layer patterns, so it fits any layer count).
    tpplan(
        "verify", "gpt2", "--plan", str(plan), "--tp", "2", "--backward", "--set", "n_layer=2",
        expect=0,
    )  # fmt: skip

    # A broken edit: c_fc split again (to save memory, say) while c_proj stays whole, so
    # c_proj would read half of c_fc's output as if it were all of it. check refuses it with
    # exit 1, one line per problem naming the rule, the module and the fix.
    broken = folder / "gpt2-broken.yaml"
    text = replace_rule(
        plan.read_text(),
        "transformer.h.*.mlp.c_fc",
        "  # split again: saves memory\n"
        "  - match: transformer.h.*.mlp.c_fc\n"
        "    style: colwise\n"
        "    transposed: true\n",
    )
    broken.write_text(text)
    out = tpplan("check", str(broken), "gpt2", "--tp", "2", expect=1)
    problems = [line for line in out.splitlines() if line.startswith("problem:")]
    if not problems or "c_fc" not in problems[0]:
        raise SystemExit("check failed without a problem line naming c_fc")
    print(f"plan-as-code workflow done; the plans are in {folder}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as folder:
            main(Path(folder))
