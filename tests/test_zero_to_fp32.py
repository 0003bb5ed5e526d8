"""fathom-zero-to-fp32 (pipeline/checkpoint/consolidated.py), which the zero_to_fp32.py fathom writes into every
save_dir runs too: the fp32 master weights of a bf16 run, where its output_dir may be, and a full disk while it
writes."""

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fathom.common.checkpoint_format import load_file
from fathom.model.model_config import ModelConfig
from fathom.model.parts import fairseq_key
from fathom.model.trained import model_config, saved_layers
from fathom.model.transformer import Transformer
from fathom.pipeline.checkpoint import masters
from fathom.pipeline.checkpoint.consolidated import WEIGHTS_FILE, main, write_recovery_scripts
from fathom.pipeline.checkpoint.masters import pipeline_names
from fathom.pipeline.checkpoint.reshape import converter_command
from tests.helpers import ROOT, built_once, launch, snapshot, write_run


@pytest.fixture
def run(tmp_path) -> Path:
    """A run whose latest checkpoint is global_step7, as training leaves it (written without DeepSpeed)."""
    torch.manual_seed(0)
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, embed_dim=8, ffn_dim=16, attention_heads=2,
                      src_vocab_size=40, tgt_vocab_size=40)  # fmt: skip
    return write_run(Transformer(cfg), tmp_path / "run", step=7)


# output_dir by what it is: (the run, the prepared data, a scratch folder) -> the path
REFUSED = {
    "the checkpoint": lambda run, data, tmp: run / "global_step7",
    "the checkpoint through a link": lambda run, data, tmp: linked(tmp / "link", run / "global_step7"),
    "a folder of the run, where its next checkpoint goes": lambda run, data, tmp: run / "global_step8",
    "the prepared data": lambda run, data, tmp: data,
}


def linked(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_output_dir_that_is_a_checkpoint_a_runs_folder_or_data_is_one_line(
    run, multi30k_slice, tmp_path, capsys, case
):
    """`fathom-zero-to-fp32 RUN RUN/global_step7` wrote RUN/global_step7/pytorch_model.bin into the committed
    checkpoint, exit 0 (a file inside a best_* checkpoint goes when a better best arrives), and into a prepared
    data directory too, as the converters' --out never does: one line naming output_dir, nothing written."""
    out = REFUSED[case](run, multi30k_slice, tmp_path)
    before = snapshot(run), snapshot(multi30k_slice)
    with pytest.raises(SystemExit) as exited:
        main([str(run), str(out)])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"fathom: error: output_dir: {out} ") and "choose" in err, err
    assert (snapshot(run), snapshot(multi30k_slice)) == before


def test_an_output_dir_beside_the_run_or_the_run_itself_takes_the_weights(run, tmp_path, capsys):
    """What the refusals leave alone: a new folder anywhere else, and the run's own folder, which takes other
    tools' files beside its records (none of which is named pytorch_model.bin)."""
    for out in (tmp_path / "fp32" / "nested", run):
        main([str(run), str(out)])
        assert capsys.readouterr().out.startswith(f"wrote {out / WEIGHTS_FILE}: {run / 'global_step7'}")
        state = torch.load(out / WEIGHTS_FILE, weights_only=True)
        assert "encoder.layers.0.fc1.weight" in state and all(v.dtype == torch.float32 for v in state.values())


def zero_to_fp32(run: Path, *args: str, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """The zero_to_fp32.py fathom wrote into the run, run as DeepSpeed's users run it; with `file_size_limit`
    (bytes) no file can grow past it, as on a full disk."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return subprocess.run([sys.executable, str(run / "zero_to_fp32.py"), str(run), *args], capture_output=True,
                          text=True, timeout=300, preexec_fn=limit if file_size_limit else None)  # fmt: skip


@pytest.mark.slow
def test_the_save_dirs_own_zero_to_fp32_refuses_its_checkpoint_in_one_line(run):
    """DeepSpeed's name in the save_dir, fathom's code: the same refusal, the checkpoint as it was."""
    write_recovery_scripts(str(run))
    before = snapshot(run)
    result = zero_to_fp32(run, str(run / "global_step7"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr[-2000:]
    assert result.stderr.startswith(f"fathom: error: output_dir: {run / 'global_step7'} is a checkpoint")
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing_behind(run, tmp_path):
    """A full disk (a file size limit makes every write past 4 kB fail as one would) printed `fathom: error:
    File too large`, naming no file, and left the new output directory behind, empty. Now one line naming
    OUTPUT_DIR/pytorch_model.bin, exit 1; a directory it made is removed, one that was there keeps its old
    weights, and no partial file is left in either."""
    write_recovery_scripts(str(run))
    new = tmp_path / "new" / "fp32"
    result = zero_to_fp32(run, str(new), file_size_limit=4096)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip() == f"fathom: error: {new / WEIGHTS_FILE}: File too large"
    assert not (tmp_path / "new").exists()

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / WEIGHTS_FILE).write_bytes(b"the weights written before")
    result = zero_to_fp32(run, str(kept), file_size_limit=4096)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip() == f"fathom: error: {kept / WEIGHTS_FILE}: File too large"
    assert [p.name for p in kept.iterdir()] == [WEIGHTS_FILE]
    assert (kept / WEIGHTS_FILE).read_bytes() == b"the weights written before"


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> Path:
    """3 bf16 steps at 2 stages x 2 replicas with ZeRO-1, so each stage's fp32 masters are cut between two
    optimizer files; the encoder and decoder share one table, which both stages keep."""

    def train(run: Path) -> None:
        args = ["--config", str(ROOT / "ds_configs" / "default.json"), "--override", f"train.save_dir={run}",
                "bf16.enabled=true", "model.encoder_layers=2", "model.decoder_layers=2",
                "model.share_all_embeddings=true", "pipeline.stages=2", "gradient_accumulation_steps=2",
                "train.max_steps=3", "train.save_interval=3"]  # fmt: skip
        assert launch(ROOT / "scripts" / "train.py", *args, processes=4).returncode == 0

    return built_once(tmp_path_factory, "zero_to_fp32_bf16", train)


def test_the_optimizer_files_keys_are_deepspeeds():
    from deepspeed.checkpoint import constants

    assert (masters.OPTIMIZER_STATE_DICT, masters.SINGLE_PARTITION_OF_FP32_GROUPS, masters.PARAM_SLICE_MAPPINGS) == (
        constants.OPTIMIZER_STATE_DICT,
        constants.SINGLE_PARTITION_OF_FP32_GROUPS,
        constants.PARAM_SLICE_MAPPINGS,
    )


def deepspeeds_masters(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master as DeepSpeed's own converter (ds_to_universal) takes it out of the
    optimizer files, by its name in the pipeline module."""
    result = subprocess.run(converter_command(checkpoint, out), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {path.parent.name: torch.load(path, weights_only=True)["param"] for path in (out / "zero").glob("*/fp32.pt")}


@pytest.mark.slow
def test_a_bf16_runs_weights_are_the_optimizers_fp32_masters(bf16_run, tmp_path):
    """fathom-zero-to-fp32 on a bf16 run wrote the bf16 weights of the layer files cast up, labelled fp32 (every
    value exactly a bf16 one), where the fp32 masters in bf16_zero_pp_rank_*_optim_states.pt differ by up to
    3e-3. Now it writes those masters, equal to DeepSpeed's own reading of them, and the zero_to_fp32.py in the
    save_dir writes the same file."""
    main([str(bf16_run), str(tmp_path / "fp32")])
    written = torch.load(tmp_path / "fp32" / WEIGHTS_FILE, weights_only=True)
    expected = deepspeeds_masters(bf16_run / "global_step3", tmp_path / "universal")
    cfg, names = model_config(bf16_run), {}
    model = Transformer(cfg)
    for prefix, part in pipeline_names(cfg).items():
        names.update({prefix + key: fairseq_key(part, key) for key in model.get_submodule(part).state_dict()})
    assert expected and set(expected) <= set(names)
    for name, master in expected.items():
        assert written[names[name]].dtype == torch.float32
        assert torch.equal(written[names[name]], master.view_as(written[names[name]])), name

    layers = [
        load_file(bf16_run / "global_step3" / f"layer_{index:02d}-model_states.pt") for index, _ in saved_layers(cfg)
    ]
    assert all(
        value.dtype == torch.bfloat16 for state in layers for value in state.values() if value.is_floating_point()
    )
    rounded = [
        value
        for value in written.values()
        if value.is_floating_point() and torch.equal(value.bfloat16().float(), value)
    ]
    assert len(rounded) < len(written) / 2, "most weights are bf16 values: the layer files' weights, not the masters"

    result = zero_to_fp32(bf16_run, str(tmp_path / "by_script"))
    assert result.returncode == 0, result.stderr[-2000:]
    again = torch.load(tmp_path / "by_script" / WEIGHTS_FILE, weights_only=True)
    assert set(again) == set(written) and all(torch.equal(again[key], written[key]) for key in written)
