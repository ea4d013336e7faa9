"""A finished run's finalists: each one's search figure against its confirmation.

    python bench/research/search_vs_confirmation.py runs/lstm_encoder

Prints, per confirmed finalist (``summary.json``'s ranking) that the run also measured in its search
(``trials.sqlite``), the search trial's speedup over the confirmed one, and the run's timing self-check.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path


def main() -> None:
    """Prints one JSON line per finalist, then the self-check."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run directory (runs/NAME)")
    run = parser.parse_args().run
    summary = json.loads((run / "best" / "summary.json").read_text())
    with sqlite3.connect(run / "trials.sqlite") as store:
        searched = {
            plan_hash: json.loads(result) for plan_hash, result in store.execute("select plan_hash, result from trials")
        }
    print(json.dumps({"fp32_ms_confirmed": round(summary["fp32_reference"]["latency_ms"], 4)}))
    for row in summary["ranking"]:
        trial = searched.get(row["plan_hash"])
        if trial and trial.get("speedup") and row.get("speedup"):
            ratio = trial["speedup"] / row["speedup"]
            print(
                json.dumps(
                    {
                        "plan": row["plan"][:70],
                        "search": round(trial["speedup"], 3),
                        "confirmed": round(row["speedup"], 3),
                        "search_over_confirmed": round(ratio, 3),
                    }
                )
            )
    print(json.dumps({"self_check": summary.get("self_check")}))


if __name__ == "__main__":
    main()
