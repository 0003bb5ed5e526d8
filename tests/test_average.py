"""Checkpoint averaging (scripts/average_checkpoints.py) on fake runs: layer files of a tiny Transformer
written as DeepSpeed writes them, with the manifests and `latest` that pipeline/checkpoint/saving.py writes."""

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fathom.common.checkpoint_format import MANIFEST, global_step, layer_file, load_file, read_manifest
from fathom.common.run_layout import BEST, LATEST, LOCK_FILE, best_tag, latest_tag
from fathom.convert.average import average_checkpoints, main
from fathom.model import Transformer
from fathom.model.model_section import parse_model
from fathom.model.norms import BranchScaled
from fathom.model.parts import saved_names
from fathom.model.trained import load_reference
from tests.helpers import contents, snapshot

MODEL = {"encoder_layers": 2, "decoder_layers": 2, "embed_dim": 16, "ffn_dim": 32, "attention_heads": 2,
         "src_vocab_size": 12, "tgt_vocab_size": 12, "norm_scheme": "branchnorm", "branchnorm": {"T": 100}}  # fmt: skip
STEPS = (8, 9, 10)  # by name, global_step10 sorts before global_step8


def write_manifest(checkpoint: Path, step: int) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "zip": True} for p in checkpoint.iterdir() if p.suffix == ".pt"}
    manifest = {"tag": checkpoint.name, "step": step, "world_size": 1, "files": files}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def write_checkpoint(save_dir: Path, tag: str, step: int, dtype=torch.float32, committed: bool = True) -> None:
    """One pipeline checkpoint of the model in config.json, with weights that depend on the step."""
    cfg = parse_model(MODEL)
    torch.manual_seed(step)
    model = Transformer(cfg).to(dtype)
    checkpoint = save_dir / tag
    checkpoint.mkdir()
    for index, name in enumerate(saved_names(cfg)):
        if name is not None:
            torch.save(model.get_submodule(name).state_dict(), layer_file(checkpoint, index))
    torch.save({"global_steps": step, "optimizer": None}, checkpoint / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, checkpoint / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    if committed:
        write_manifest(checkpoint, step)


def make_run(save_dir: Path, dtype=torch.float32) -> Path:
    save_dir.mkdir()
    (save_dir / "config.json").write_text(json.dumps({"model": MODEL}))
    for step in STEPS:
        write_checkpoint(save_dir, f"global_step{step}", step, dtype)
    (save_dir / LATEST).write_text(f"global_step{STEPS[-1]}")
    return save_dir


@pytest.fixture
def run(tmp_path) -> Path:
    """Committed global_step8..10, `latest` at 10, plus what averaging must not pick: a crashed save at
    step 11 (no manifest) and a best checkpoint at step 12 with its link."""
    save_dir = make_run(tmp_path / "run")
    write_checkpoint(save_dir, "global_step11", 11, committed=False)
    write_checkpoint(save_dir, best_tag(12), 12)
    (save_dir / BEST).symlink_to(best_tag(12))
    return save_dir


def layers(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {path.name: load_file(path) for path in sorted(checkpoint.glob("layer_*-model_states.pt"))}


def mean_of(save_dir: Path, steps) -> dict[str, dict[str, torch.Tensor]]:
    sources = [layers(save_dir / f"global_step{step}") for step in steps]
    return {
        name: {key: (sum(s[name][key].double() for s in sources) / len(sources)).to(value.dtype)
               for key, value in tensors.items()}
        for name, tensors in sources[0].items()
    }  # fmt: skip


def assert_same_layers(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(got) == 7
    for name, tensors in want.items():
        assert got[name].keys() == tensors.keys(), name
        for key, tensor in tensors.items():
            assert got[name][key].dtype == tensor.dtype and torch.equal(got[name][key], tensor), f"{name} {key}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_of_three_is_their_mean_in_each_tensors_dtype(tmp_path, capsys, dtype):
    save_dir = make_run(tmp_path / "run", dtype)
    main(["--checkpoint", str(save_dir), "--last", "3"])
    assert "wrote" in capsys.readouterr().out
    average = save_dir / "avg_last3"
    assert_same_layers(layers(average), mean_of(save_dir, STEPS))
    assert not torch.equal(layers(average)["layer_01-model_states.pt"]["fc1.weight"],
                           layers(save_dir / "global_step10")["layer_01-model_states.pt"]["fc1.weight"])  # fmt: skip


def test_load_reference_reads_the_average_at_the_newest_step(run, capsys):
    main(["--checkpoint", str(run), "--last", "3"])
    model = load_reference(run, "avg_last3")
    sources = [load_reference(run, f"global_step{step}").state_dict() for step in STEPS]
    for key, value in model.state_dict().items():
        assert torch.equal(value, (sum(s[key].double() for s in sources) / 3).float()), key
    average = run / "avg_last3"
    assert global_step(average) == 10
    assert {m.branch_scale for m in model.modules() if isinstance(m, BranchScaled)} == {0.1}  # alpha_t at 10 of 100
    # nothing to resume from, and the run's own pointers untouched
    manifest = read_manifest(average)
    assert (manifest["step"], manifest["schedule_step"], manifest["shape"]) == (10, 10, None)
    assert sorted(manifest["files"]) == sorted(p.name for p in average.iterdir() if p.name != MANIFEST)
    assert not list(average.glob("*optim_states*")) and not (average / "mp_rank_00_model_states.pt").exists()
    assert latest_tag(run) == "global_step10" and (run / BEST).readlink().name == "best_global_step12"
    summary = json.loads((average / "fathom_average.json").read_text())
    assert summary["averaged"] == ["global_step8", "global_step9", "global_step10"] and summary["global_steps"] == 10


def test_last_takes_the_newest_committed_steps_by_number(run, capsys, monkeypatch):
    import fathom.convert.average

    read = []
    monkeypatch.setattr(fathom.convert.average, "load_file", lambda path: read.append(path) or load_file(path))
    main(["--checkpoint", str(run), "--last", "2"])
    assert_same_layers(layers(run / "avg_last2"), mean_of(run, (9, 10)))
    # one layer file at a time, across the checkpoints in turn
    assert [(p.parent.name, p.name) for p in read[:3]] == [
        ("global_step9", "layer_00-model_states.pt"),
        ("global_step10", "layer_00-model_states.pt"),
        ("global_step9", "layer_01-model_states.pt"),
    ]


def test_tags_name_the_output_after_their_steps_and_force_replaces_it(run, capsys):
    main(["--checkpoint", str(run), "--tags", "global_step10", "global_step8"])
    assert_same_layers(layers(run / "avg_8_10"), mean_of(run, (8, 10)))
    main(["--checkpoint", str(run), "--tags", "global_step9", "global_step10", "--out-tag", "avg_8_10", "--force"])
    assert_same_layers(layers(run / "avg_8_10"), mean_of(run, (9, 10)))
    assert not [p for p in run.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE]  # no staging left


def test_the_python_api_averages_as_the_command_does(tmp_path, capsys):
    """average_checkpoints(run_dir, tags=...) writes the tag the command writes, file for file."""
    by_command, by_api = make_run(tmp_path / "command"), make_run(tmp_path / "api")
    main(["--checkpoint", str(by_command), "--tags", "global_step10", "global_step8"])
    tag, summary = average_checkpoints(by_api, tags=["global_step10", "global_step8"])
    assert tag == "avg_8_10" and summary == json.loads((by_api / tag / "fathom_average.json").read_text())
    assert contents(by_api / tag) == contents(by_command / tag)


@pytest.mark.slow
def test_the_script_averages(run, root):
    result = subprocess.run(
        [sys.executable, "scripts/average_checkpoints.py", "--checkpoint", str(run), "--tags", "best", "global_step9"],
        cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"wrote {run / 'avg_9_best'}: the mean of global_step9, best" in result.stdout
    assert global_step(run / "avg_9_best") == 12


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_leaves_no_tag(run, root):
    """torch's zip writer reported a failed write as `RuntimeError: unexpected pos`, a traceback."""
    before = snapshot(run)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    result = subprocess.run(
        [sys.executable, "scripts/average_checkpoints.py", "--checkpoint", str(run), "--last", "2"], cwd=root,
        capture_output=True, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard)),
    )  # fmt: skip
    err = result.stderr.strip()
    assert result.returncode == 1 and len(err.splitlines()) == 1 and err.endswith(": File too large"), err
    assert snapshot(run) == before


def replace_layer(run: Path, tag: str, index: int, change) -> None:
    """Rewrites one layer file of a committed checkpoint (and its manifest, so only the contents differ)."""
    path = layer_file(run / tag, index)
    state = load_file(path)
    change(state)
    torch.save(state, path)
    write_manifest(run / tag, int(tag.removeprefix("global_step")))


def average_first(run: Path) -> None:
    main(["--checkpoint", str(run), "--last", "3"])


def same_step(run: Path) -> None:
    """A regular checkpoint at the best checkpoint's step (training saves both when they coincide)."""
    write_checkpoint(run, "global_step12", 12)


BAD = {
    "not a run": (None, ["--checkpoint", "{run}/global_step9", "--last", "2"], "not a training directory"),
    "no such tag": (None, ["--tags", "global_step9", "global_step99"], "no checkpoint tagged 'global_step99'; pass"),
    "last 1": (None, ["--last", "1"], "--last 1: averaging needs at least 2 checkpoints"),
    "last 0": (None, ["--last", "0"], "--last 0: averaging needs at least 2 checkpoints"),
    "last 5 of 3": (None, ["--last", "5"], "has 3 committed checkpoints (global_step8, global_step9, global_step10)"),
    "same tag twice": (None, ["--tags", "global_step9", "global_step9"], "are the same checkpoint"),
    "best and its target": (None, ["--tags", "best", "best_global_step12"], "are the same checkpoint"),
    "one tag": (None, ["--tags", "global_step9"], "needs at least 2 checkpoints, got 1"),
    "uncommitted tag": (None, ["--tags", "global_step10", "global_step11"], "a save that did not finish"),
    "hidden tag": (None, ["--tags", "global_step9", ".."], "'..' is not a tag"),
    "both": (None, ["--last", "2", "--tags", "global_step9", "global_step10"], "pass exactly one of --last"),
    "neither": (None, [], "pass exactly one of --last"),
    "existing output": (average_first, ["--last", "3"], "avg_last3 already exists; choose another --out-tag or"),
    "output not ours": (None, ["--last", "2", "--out-tag", "global_step9x", "--force"], "the run keeps for its"),
    "output is latest": (None, ["--last", "2", "--out-tag", "latest"], "the run keeps for its"),
    # names the run writes later: a resume failed (grad_norms.jsonl: Is a directory), or validation
    # translations landed inside the averaged checkpoint
    **{
        f"output is the run's {name}": (None, ["--last", "2", "--out-tag", name], "a name the run keeps for its")
        for name in (
            "grad_norms.jsonl",
            "translations",
            "metrics.jsonl",
            "config_history.jsonl",
            "heartbeat-rank1.json",
            "generate-test.txt",
            "loss.png",
        )
    },  # fmt: skip
    # best_global_stepN and global_stepN are saved after the same step: "the mean" of the two is step N
    "best and the same step": (same_step, ["--tags", "best", "global_step12"], "(both saved after step 12)"),
    "best tag and the same step": (
        same_step,
        ["--tags", "best_global_step12", "global_step12"],
        "are the same checkpoint (both saved after",
    ),
    "output a checkpoint": (
        lambda run: (run / "fairseq").mkdir(),
        ["--last", "2", "--out-tag", "fairseq", "--force"],
        "fairseq exists and was not written by this script",
    ),
    "shape": (
        lambda run: replace_layer(run, "global_step9", 1, lambda s: s.update({"fc1.bias": torch.zeros(33)})),
        ["--last", "3"],
        "'fc1.bias' is float32 [33] but float32 [32] in",
    ),
    "dtype": (
        lambda run: replace_layer(run, "global_step9", 4, lambda s: s.update({"fc2.bias": s["fc2.bias"].double()})),
        ["--last", "3"],
        "'fc2.bias' is float64 [16] but float32 [16] in",
    ),
    "tensor names": (
        lambda run: replace_layer(run, "global_step10", 2, lambda s: s.update({"fc3.weight": s.pop("fc2.weight")})),
        ["--last", "3"],
        "the checkpoints are from different models",
    ),
    "extra layer file": (
        lambda run: torch.save({}, layer_file(run / "global_step8", 99)),
        ["--last", "3"],
        "has layer_99-model_states.pt, which the model in",
    ),
    "missing layer file": (
        lambda run: layer_file(run / "global_step8", 2).unlink(),
        ["--last", "3"],
        "1 of 7 layer files missing",
    ),
    "truncated layer file": (
        lambda run: layer_file(run / "global_step8", 1).write_bytes(b"\0" * 10),
        ["--last", "3"],
        "10 bytes, but",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line_and_writes_nothing(run, capsys, case):
    setup, args, message = BAD[case]
    if setup is not None:
        setup(run)
    argv = [arg.format(run=run) for arg in args]
    if "--checkpoint" not in argv:
        argv = ["--checkpoint", str(run), *argv]
    capsys.readouterr()
    before = snapshot(run)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fathom: error: "), err
    assert message in err, err
    assert snapshot(run) == before, "a refused average changed the run directory"


def test_alpha_is_read_at_the_updates_a_checkpoint_applied(run):
    """A run that skipped non-finite steps, or started from train.init_from's weights, records the
    schedule step in the manifest; generation, export and averaging read alpha_t there."""
    manifest = json.loads((run / "global_step10" / MANIFEST).read_text())
    (run / "global_step10" / MANIFEST).write_text(json.dumps({**manifest, "schedule_step": 4}))
    model = load_reference(run, "global_step10")
    assert {m.branch_scale for m in model.modules() if isinstance(m, BranchScaled)} == {0.04}
    main(["--checkpoint", str(run), "--tags", "global_step9", "global_step10"])
    assert read_manifest(run / "avg_9_10")["schedule_step"] == 4
