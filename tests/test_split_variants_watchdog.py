"""benchmarks/split_variants.py's sweep outlives a case that hangs: the ranks are stopped, the
case is reported as hung on every rank, and a new launch goes on past it. Stand-in ranks (a
script that logs as the real ones do) take the place of `mlx.launch`."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import split_variants  # noqa: E402

# Two ranks; four cases; case 1 hangs (rank 1 stopped in the middle of a line).
RANKS = '''
import json, sys, time, os
out = sys.argv[1]
paths = [os.path.join(out, f"rank{rank}.jsonl") for rank in (0, 1)]
ended = set()
if os.path.exists(paths[0]):
    ended = {json.loads(line).get("name") for line in open(paths[0])}
logs = [open(p, "a") for p in paths]
for index in range(4):
    if f"case{index}" in ended:
        continue
    for log in logs:
        log.write(json.dumps({"index": index, "start": f"case{index}"}) + "\\n"); log.flush()
    if index == 1:
        logs[1].write('{"name": "case1", "outc'); logs[1].flush()  # stopped mid-line
        time.sleep(60)
    for log in logs:
        log.write(json.dumps({"name": f"case{index}", "option": "o", "outcome": "exact", "seconds": 0}) + "\\n")
        log.flush()
'''


def test_a_hung_case_is_reported_and_the_sweep_goes_on_past_it(tmp_path, capsys):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    split_variants._launch_until_done([sys.executable, str(script), str(tmp_path)], str(tmp_path), 2,
                                      case_timeout=2)
    logs = split_variants._read_logs(str(tmp_path), 2)
    for done, open_case in logs:
        assert open_case is None
        assert sorted(done) == ["case0", "case1", "case2", "case3"]
        assert done["case1"]["outcome"] == "hung: no rank ended it within 2 s"
        assert all(done[f"case{i}"]["outcome"] == "exact" for i in (0, 2, 3))
    assert "case1: hung; launching again past it" in capsys.readouterr().err
    # the line the stopped launch left half-written is passed over, and the next one starts a line
    lines = (tmp_path / "rank1.jsonl").read_text().splitlines()
    assert lines.count('{"name": "case1", "outc') == 1
    [json.loads(line) for line in lines if line != '{"name": "case1", "outc']
