"""Export to fairseq and import back, checked against real fairseq 0.12.2, run from its own Python 3.10
environment (scripts/setup_fairseq_env.sh builds it once and caches it)."""

from __future__ import annotations

import argparse
import json
import math
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from fathom.common.errors import ConfigError
from fathom.convert import from_fairseq, to_fairseq
from fathom.corpus.batches import collate
from fathom.corpus.dataset import BinarizedCorpus, PreparedData, check_vocab
from fathom.corpus.prepare import main as prepare_main
from fathom.model.model_config import ModelConfig
from fathom.model.norms import SCHEMES
from fathom.model.search import SearchConfig
from fathom.model.trained import load_reference
from fathom.model.transformer import Transformer
from fathom.pipeline.launch.checks import check_run, parse_train_args
from fathom.tools.translation_speed import search_flags
from fathom.translation.generate import main as generate_main
from tests.helpers import ROOT, built_once, contents, edit_prepared, fold_model, launch, write_slice

EXPORTED = [name for name, scheme in SCHEMES.items() if scheme.fairseq_layout is not None]  # the registry's
SMALL = "model.encoder_layers=3,model.decoder_layers=3,model.embed_dim=32,model.ffn_dim=64,model.attention_heads=4"
# Enough training for real (if poor) sentences, so equal hypotheses mean something.
STEPS = (
    "train.max_steps=100,train.save_interval=100,train.log_interval=100,train.valid_interval=100,"
    "optimizer.params.lr=0.003,"
    "scheduler.params.warmup_max_lr=0.003,scheduler.params.warmup_num_steps=10,"
    "train_micro_batch_size_per_gpu=16,gradient_accumulation_steps=2"
)
# The three ways of sharing embeddings, over the exportable schemes in turn; BranchNorm stops at alpha_t = 0.5;
# post_ln's export carries a label smoothing other than the default into fairseq-validate's criterion.
SHARING = ["model.share_decoder_input_output_embed=true", "model.share_all_embeddings=true",
           "model.share_all_embeddings=false"]  # fmt: skip
LABEL_SMOOTHING = 0.2
OPTIONS = {"branchnorm": "model.branchnorm.T=200", "post_ln": f"train.label_smoothing={LABEL_SMOOTHING}"}
CASES = {
    **{
        name: ",".join(filter(None, [f"model.norm_scheme={name}", SHARING[i % 3], OPTIONS.get(name), SMALL, STEPS]))
        for i, name in enumerate(EXPORTED)
    },
    # 107 pipeline layers: files layer_100-... and up sort after layer_99 only numerically
    "deep": "model.norm_scheme=post_ln,model.encoder_layers=52,model.decoder_layers=52,model.embed_dim=16,"
    "model.ffn_dim=32,model.attention_heads=2,train.max_steps=1",
}
TOLERANCE = 1e-4  # the bound on log-probability differences against fairseq


def convert_to(run: Path, data: Path, out: Path, *extra: str) -> None:
    to_fairseq.main(["--checkpoint", str(run), "--data", str(data), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, multi30k_slice) -> Path:
    """Every case trained with 2 pipeline stages on real Multi30k pairs (one launch)."""

    def train(out: Path) -> None:
        cases = [f"{name}={overrides},data.path={multi30k_slice}" for name, overrides in CASES.items()]
        worker, config = ROOT / "tests" / "workers" / "train_cases.py", ROOT / "ds_configs" / "default.json"
        result = launch(worker, str(config), str(out), *cases)
        assert result.returncode == 0, "the training worker failed (its output is above)"

    return built_once(tmp_path_factory, "fairseq_runs", train)


@pytest.fixture(scope="module")
def exported(runs, multi30k_slice, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("exported")
    for case in CASES:
        convert_to(runs / case, multi30k_slice, out / case)
    return {case: out / case for case in CASES}


def sample_batch(data: Path, pairs: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    corpus = BinarizedCorpus(data, "test")
    (src, prev), _ = collate([corpus.pair(i) for i in range(pairs)])
    return src, prev


def our_log_probs(save_dir: Path, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(load_reference(save_dir)(src, prev), dim=-1)


def fairseq_log_probs(
    fairseq_bin: Path, checkpoints: dict[str, Path], batch, tmp_path: Path
) -> dict[str, torch.Tensor]:
    """Log-probabilities from fairseq's own model, loaded strictly by its own loader."""
    torch.save(batch, tmp_path / "inputs.pt")
    args = [arg for name, path in checkpoints.items() for arg in (str(path), str(tmp_path / f"{name}.lp.pt"))]
    result = subprocess.run(
        [
            str(fairseq_bin / "python"),
            str(ROOT / "tests" / "workers" / "fairseq_logprobs.py"),
            str(tmp_path / "inputs.pt"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return {name: torch.load(tmp_path / f"{name}.lp.pt") for name in checkpoints}


def max_difference(a: torch.Tensor, b: torch.Tensor, prev: torch.Tensor) -> float:
    """Over real target positions (the models may differ on padding, which no loss or search reads)."""
    return (a - b).abs()[prev.ne(1)].max().item()


@pytest.mark.slow
def test_fairseq_loads_exports_and_scores_identically(exported, runs, multi30k_slice, fairseq_bin, tmp_path):
    """fairseq's load_model_ensemble_and_task (strict) takes every exported checkpoint, the >100-layer
    one included, and its log-probabilities equal ours within 1e-4."""
    src, prev = sample_batch(multi30k_slice)
    theirs = fairseq_log_probs(fairseq_bin, {c: exported[c] / "checkpoint.pt" for c in CASES}, (src, prev), tmp_path)
    for case in CASES:
        ours = our_log_probs(runs / case, src, prev)
        assert max_difference(ours, theirs[case], prev) < TOLERANCE, case
        summary = json.loads((exported[case] / to_fairseq.SUMMARY).read_text())
        assert summary["max_abs_log_prob_difference"] < TOLERANCE, case
    assert (runs / "deep" / "global_step1" / "layer_106-model_states.pt").exists()


def plain(value: object) -> bool:
    """Only what torch.load's weights_only unpickler and JSON both know: no object of any class."""
    if isinstance(value, dict):
        return all(isinstance(key, str) and plain(item) for key, item in value.items())
    if isinstance(value, list):
        return all(map(plain, value))
    return value is None or isinstance(value, str | int | float | bool)


def test_an_exports_config_is_plain_containers_with_the_runs_arguments(tmp_path):
    """The fast tier's check of what test_exports_load_with_weights_only checks on real exports: the saved
    config loads with weights_only=True, and each argument sits in every section with a field of its name."""
    cfg = ModelConfig(encoder_layers=2, decoder_layers=2, embed_dim=16, ffn_dim=32, attention_heads=2,
                      src_vocab_size=20, tgt_vocab_size=20)  # fmt: skip
    corpus = argparse.Namespace(src="de", tgt="en")
    args = to_fairseq.fairseq_run_args(cfg, {"label_smoothing": 0.3, "seed": 7}, corpus, tmp_path, [])
    saved = to_fairseq.fairseq_checkpoint(to_fairseq.fairseq_train_config(args), {}, {"step": 3})
    torch.save(saved, tmp_path / "checkpoint.pt")
    loaded = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert loaded == saved and plain(loaded["cfg"]) and loaded["args"] is None
    sections = loaded["cfg"]
    assert sections["model"] == {**args, "_name": "transformer"} and sections["bpe"] is None
    assert sections["common"]["seed"] == 7 and sections["criterion"]["label_smoothing"] == 0.3
    assert sections["task"]["data"] == str(tmp_path.resolve()) and sections["task"]["max_source_positions"] == 1024
    assert sections["dataset"]["dataset_impl"] == sections["task"]["dataset_impl"] == "raw"


@pytest.mark.slow
def test_exports_load_with_weights_only(exported):
    """fairseq 0.12.2 loads a checkpoint with torch.load's defaults, which since torch 2.6 unpickle only
    tensors and plain containers: an export that pickled its run's argparse.Namespace stopped
    fairseq-interactive there with "Unsupported global: GLOBAL argparse.Namespace". Every export loads
    with weights_only=True and nothing allowed beyond, its config held as fairseq-train records one
    (`args` None, `cfg` plain containers, sections named by `_name`)."""
    for case in CASES:
        checkpoint = torch.load(exported[case] / "checkpoint.pt", weights_only=True)
        assert checkpoint["args"] is None, case
        cfg = checkpoint["cfg"]
        assert plain(cfg) and plain(checkpoint["extra_state"]) and plain(checkpoint["optimizer_history"]), case
        assert (cfg["model"]["_name"], cfg["task"]["_name"]) == ("transformer", "translation"), case
        assert cfg["criterion"]["_name"] == "label_smoothed_cross_entropy", case


@pytest.mark.slow
def test_an_exports_config_is_the_one_fairseq_makes_of_its_arguments(exported, fairseq_bin, tmp_path):
    """An export's config (model section: the run's arguments) is, section for section and field for field,
    what fairseq 0.12.2's own convert_namespace_to_omegaconf makes of the run's arguments, as fairseq-train
    makes the config it saves (tests/workers/fairseq_config.py), base_architecture finding nothing to add to
    the model section; and so is fathom's config for a run without one SentencePiece model for both sides."""
    configs = {case: torch.load(exported[case] / "checkpoint.pt", weights_only=True)["cfg"] for case in CASES}
    arguments = {case: {k: v for k, v in cfg["model"].items() if k != "_name"} for case, cfg in configs.items()}
    arguments["no_bpe"] = {k: v for k, v in arguments["post_ln"].items() if k not in ("bpe", "sentencepiece_model")}
    configs["no_bpe"] = to_fairseq.fairseq_train_config(arguments["no_bpe"])
    assert configs["no_bpe"]["bpe"] is None and configs["post_ln"]["bpe"]["_name"] == "sentencepiece"
    files = []
    for case, args in arguments.items():
        (tmp_path / f"{case}.args.json").write_text(json.dumps(args))
        files += [str(tmp_path / f"{case}.args.json"), str(tmp_path / f"{case}.cfg.json")]
    worker = ROOT / "tests" / "workers" / "fairseq_config.py"
    result = subprocess.run([str(fairseq_bin / "python"), str(worker), *files], capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    for case, cfg in configs.items():
        assert json.loads((tmp_path / f"{case}.cfg.json").read_text()) == cfg, case


def fairseq_generate(
    fairseq_bin: Path, jobs: list[tuple[Path, str]], search: SearchConfig, out: Path
) -> list[list[tuple[str, str]]]:
    """For each (export, split): (source pieces, hypothesis pieces) of every sentence of the split, in its
    order, from fairseq-generate's own code (cli_main) run on each in turn in one fairseq process."""
    commands = [
        [str(export), "--path", str(export / "checkpoint.pt"), "--dataset-impl", "raw", "--gen-subset", subset]
        + ["--cpu", *search_flags(search), "--results-path", str(out / str(i))]
        for i, (export, subset) in enumerate(jobs)
    ]
    out.mkdir()
    (out / "jobs.json").write_text(json.dumps(commands), encoding="utf-8")
    result = subprocess.run(
        [str(fairseq_bin / "python"), str(ROOT / "tests" / "workers" / "fairseq_generate.py"), str(out / "jobs.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [read_generated((out / str(i) / f"generate-{subset}.txt").read_text(encoding="utf-8"))
            for i, (_, subset) in enumerate(jobs)]  # fmt: skip


def read_generated(output: str) -> list[tuple[str, str]]:
    sources, hypotheses = {}, {}
    for line in output.split("\n"):  # a hypothesis may hold U+2028
        if line.startswith(("S-", "H-")):
            index, *_, pieces = line.split("\t")
            (sources if line[0] == "S" else hypotheses)[int(index[2:])] = pieces
    assert sorted(sources) == sorted(hypotheses) == list(range(len(sources)))
    return [(sources[i], hypotheses[i]) for i in range(len(sources))]


@pytest.mark.slow
def test_fairseq_generate_gives_our_hypotheses(exported, runs, multi30k_slice, fairseq_bin, tmp_path):
    """fairseq-generate on the exported test split (the valid split too for one scheme) = our generate.py
    with its default settings, sentence by sentence, fairseq given the same settings. The output limit,
    1.2 x the longest source of the batch + 10, cuts hypotheses of these barely trained models, so which
    sentences share a batch decides them: 10 sentences a batch, which fairseq makes batches of 8
    (--required-batch-size-multiple 8), in its order (source length, then target length; a split not
    named test shuffled first with its --seed 1). fairseq-generate's code runs in one fairseq process for
    all of them (tests/workers/fairseq_generate.py)."""
    detok = spm.SentencePieceProcessor(model_file=str(multi30k_slice / "spm.model"))
    search = SearchConfig(batch_size=10)
    jobs = [(case, subset) for case in EXPORTED for subset in (["test", "valid"] if case == EXPORTED[0] else ["test"])]
    ours = {}
    for case, subset in jobs:
        ours_file = tmp_path / f"{case}.{subset}.txt"
        generate_main(
            ["--checkpoint", str(runs / case), "--data", str(multi30k_slice), "--subset", subset]
            + ["--batch-size", str(search.batch_size), "--output", str(ours_file)]
        )
        ours[case, subset] = ours_file.read_text(encoding="utf-8").splitlines()
    generated = fairseq_generate(fairseq_bin, [(exported[c], s) for c, s in jobs], search, tmp_path / "fairseq")
    distinct, over_own_limit = set(), 0
    for (case, subset), theirs in zip(jobs, generated, strict=True):
        assert len(theirs) == len(ours[case, subset]) == {"test": 50, "valid": 60}[subset], case
        assert sum(map(bool, ours[case, subset])) > 40, case
        assert [detok.decode_pieces(hyp.split()) for _, hyp in theirs] == ours[case, subset], (case, subset)
        distinct.update(ours[case, subset])
        # longer than its own source allows: the batch's longest source set its limit
        own_limit = [int(search.max_len_a * (len(src.split()) + 1) + search.max_len_b) for src, _ in theirs]
        over_own_limit += sum(len(hyp.split()) > limit for (_, hyp), limit in zip(theirs, own_limit, strict=True))
    assert len(distinct) > 30  # real (if poor) sentences, not one line the models all repeat
    assert over_own_limit > 0


def last_validation(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if "valid_loss" in record][-1]


@pytest.mark.slow
def test_fairseqs_criterion_gives_our_validation_loss(exported, runs, fairseq_bin, tmp_path):
    """fairseq-validate's computation (its batches of the export's valid split, the label-smoothed
    criterion the export records, its reduce_metrics) gives the validation loss the training run logged
    at its last step: the loss over all target tokens divided by their count, label-smoothed (fairseq's
    `loss`) and not (`nll_loss`), in nats and in fairseq's bits; unrounded, where fairseq-validate prints
    3 decimals (test_fairseq_commands_run_on_an_export runs the command itself)."""
    outputs = [arg for case in EXPORTED for arg in (str(exported[case]), str(tmp_path / f"{case}.json"))]
    result = subprocess.run(
        [str(fairseq_bin / "python"), str(ROOT / "tests" / "workers" / "fairseq_validate.py"), *outputs],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for case in EXPORTED:
        theirs, ours = json.loads((tmp_path / f"{case}.json").read_text()), last_validation(runs / case)
        assert ours["step"] == 100, case
        assert ours["valid_loss"] == pytest.approx(theirs["loss"] * math.log(2), abs=TOLERANCE), case
        assert ours["valid_nll_loss"] == pytest.approx(theirs["nll_loss"] * math.log(2), abs=TOLERANCE), case
        assert ours["valid_loss_bits"] == pytest.approx(theirs["loss"], abs=TOLERANCE), case
        assert ours["valid_nll_loss_bits"] == pytest.approx(theirs["nll_loss"], abs=TOLERANCE), case


def raw_sentences(data: Path, out: Path, lines: int = 8) -> Path:
    """The first raw source sentences of the data's test split, one a line."""
    text = (data / "test.raw.de").read_text(encoding="utf-8").split("\n")[:lines]
    out.write_text("".join(line + "\n" for line in text), encoding="utf-8")
    return out


def run_fairseq(fairseq_bin: Path, command: str, *args: str, stdin: Path | None = None) -> str:
    """A fairseq command's stdout; it must succeed."""
    with open(stdin or "/dev/null", encoding="utf-8") as source:
        result = subprocess.run([str(fairseq_bin / command), *args], stdin=source, capture_output=True, text=True,
                                timeout=600)  # fmt: skip
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.slow
def test_fairseq_commands_run_on_an_export(exported, runs, multi30k_slice, fairseq_bin, tmp_path):
    """The export works in every fairseq command a user runs on a trained model (fairseq-generate:
    test_fairseq_generate_gives_our_hypotheses): fairseq-interactive and TransformerModel.from_pretrained
    translate raw text exactly as our translate.py does, and fairseq-validate scores the exported valid split
    with the run's criterion to the validation loss the run logged (it failed with "Key 'criterion' is not
    in struct": the export's cfg had only the model and the task)."""
    export, source = exported["post_ln"], raw_sentences(multi30k_slice, tmp_path / "input.de")
    # a limit of its own for each sentence, so that batching decides nothing (fairseq-interactive: one a batch)
    search = search_flags(SearchConfig(beam=4, lenpen=0.6, max_len_a=0, max_len_b=40, batch_size=1))
    ours = subprocess.run(
        ["python", str(ROOT / "scripts" / "translate.py"), "--checkpoint", str(runs / "post_ln"), "--data",
         str(multi30k_slice), "--input", str(source), *search],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr[-3000:]
    translations = ours.stdout.splitlines()
    assert len(translations) == 8 and sum(map(bool, translations)) > 6

    interactive = run_fairseq(
        fairseq_bin, "fairseq-interactive", str(export), "--path", str(export / "checkpoint.pt"), "-s", "de",
        "-t", "en", "--bpe", "sentencepiece", "--sentencepiece-model", str(export / "spm.model"), "--cpu", *search,
        stdin=source,
    )  # fmt: skip
    detokenized = dict(line[2:].split("\t")[::2] for line in interactive.splitlines() if line.startswith("D-"))
    assert [detokenized[str(i)] for i in range(8)] == translations

    hub = tmp_path / "hub.json"
    result = subprocess.run(
        [str(fairseq_bin / "python"), str(ROOT / "tests" / "workers" / "fairseq_hub.py"), str(export), str(source),
         str(hub)], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = json.loads(hub.read_text())
    assert loaded["translations"] == translations
    criterion = loaded["criterion"]
    assert (criterion["_name"], criterion["label_smoothing"]) == ("label_smoothed_cross_entropy", LABEL_SMOOTHING)
    assert criterion["sentence_avg"] is False  # fathom averages over target tokens

    validate = run_fairseq(
        fairseq_bin, "fairseq-validate", str(export), "--path", str(export / "checkpoint.pt"), "--task",
        "translation", "--batch-size", "64", "--cpu",
    )  # fmt: skip
    [line] = [line for line in validate.splitlines() if "valid on 'valid' subset" in line]
    scores = dict(field.strip().split(" ", 1) for field in line.split(" | ")[1:] if " " in field.strip())
    logged = last_validation(runs / "post_ln")  # in bits per target token, as fairseq prints: 3 decimals
    assert float(scores["loss"]) == pytest.approx(logged["valid_loss_bits"], abs=5e-4 + TOLERANCE), line
    assert float(scores["nll_loss"]) == pytest.approx(logged["valid_nll_loss_bits"], abs=5e-4 + TOLERANCE), line


@pytest.mark.slow
def test_exports_import_back(exported, runs, multi30k_slice, tmp_path):
    """fairseq -> ours: a Post-LN or Pre-LN export comes back with the very same weights; a folded
    scheme comes back as the fairseq-layout model that computes what it computed."""
    src, prev = sample_batch(multi30k_slice)
    for case in EXPORTED:
        back = tmp_path / case
        from_fairseq.main(["--fairseq-checkpoint", str(exported[case] / "checkpoint.pt"), "--out", str(back)])
        imported, original = load_reference(back), load_reference(runs / case)
        if SCHEMES[case].fairseq_layout == case:  # nothing to fold
            assert imported.state_dict().keys() == original.state_dict().keys()
            for key, value in original.state_dict().items():
                assert torch.equal(imported.state_dict()[key], value), (case, key)
        folded = fold_model(original)
        assert imported.cfg == folded.cfg, case
        assert max_difference(our_log_probs(back, src, prev), our_log_probs(runs / case, src, prev), prev) < TOLERANCE


@pytest.mark.slow
def test_the_python_api_exports_and_imports_as_the_commands_do(runs, multi30k_slice, tmp_path):
    """to_fairseq.export and from_fairseq.import_fairseq write, file for file, what the commands write
    to the same place (an export records its own path), and return their summary and model."""
    out, back = tmp_path / "export", tmp_path / "import"
    summary = to_fairseq.export(runs / "post_ln", multi30k_slice, out, splits=["test"])
    by_api = contents(out)
    convert_to(runs / "post_ln", multi30k_slice, out, "--splits", "test", "--force")
    assert contents(out) == by_api and summary == json.loads((out / to_fairseq.SUMMARY).read_text())
    model, languages = from_fairseq.import_fairseq(out / "checkpoint.pt", back)
    by_api = contents(back)
    from_fairseq.main(["--fairseq-checkpoint", str(out / "checkpoint.pt"), "--out", str(back), "--force"])
    assert contents(back) == by_api and languages == ["de", "en"] and model == load_reference(back).cfg


@pytest.mark.slow
def test_fairseq_trained_model_imports_and_initializes_a_run(exported, multi30k_slice, fairseq_bin, tmp_path):
    """A model trained by fairseq-train itself (Pre-LN, learned positions) imports with equal
    log-probabilities, and a 2-stage run started from it (train.init_from) holds its weights."""
    data = tmp_path / "fairseq-data"  # an export's dictionaries, with the training split added
    shutil.copytree(exported["post_ln"], data)
    to_fairseq.write_raw_split(multi30k_slice, "train", data)
    result = subprocess.run(
        [str(fairseq_bin / "fairseq-train"), str(data), "--dataset-impl", "raw", "--arch", "transformer"]
        + ["--encoder-layers", "2", "--decoder-layers", "3", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32"]
        + ["--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4"]
        + ["--decoder-attention-heads", "4", "--encoder-normalize-before", "--decoder-normalize-before"]
        + ["--encoder-learned-pos", "--decoder-learned-pos", "--share-decoder-input-output-embed"]
        + ["--optimizer", "adam", "--lr", "0.001", "--max-tokens", "2000", "--max-update", "5", "--cpu"]
        + ["--save-dir", str(tmp_path / "fs"), "--no-epoch-checkpoints", "--disable-validation", "--seed", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    fairseq_checkpoint = tmp_path / "fs" / "checkpoint_last.pt"
    # fairseq-train pickles an argparse.Namespace itself, as its config's model section (arch transformer has
    # no config class), which the import allows, as a safe global
    with pytest.raises(pickle.UnpicklingError, match="GLOBAL argparse.Namespace"):
        torch.load(fairseq_checkpoint, weights_only=True)
    imported = tmp_path / "imported"
    from_fairseq.main(["--fairseq-checkpoint", str(fairseq_checkpoint), "--out", str(imported)])

    src, prev = sample_batch(multi30k_slice)
    theirs = fairseq_log_probs(fairseq_bin, {"trained": fairseq_checkpoint}, (src, prev), tmp_path)["trained"]
    assert max_difference(our_log_probs(imported, src, prev), theirs, prev) < TOLERANCE

    # lr 0: one step changes nothing, so the run's checkpoint must hold exactly the imported weights
    run = tmp_path / "run"
    overrides = (
        f"model.norm_scheme=pre_ln,model.encoder_layers=2,model.decoder_layers=3,model.embed_dim=32,model.ffn_dim=64,"
        f"model.attention_heads=4,model.learned_pos=true,model.share_decoder_input_output_embed=true,"
        f"data.path={multi30k_slice},train.init_from={imported},train.max_steps=1,scheduler.params.warmup_max_lr=0"
    )
    result = launch(
        ROOT / "tests" / "workers" / "train_cases.py",
        str(ROOT / "ds_configs" / "default.json"),
        str(tmp_path),
        f"run={overrides}",
    )
    assert result.returncode == 0, "the training worker failed (its output is above)"
    assert f"initialized from {imported}" in result.stdout
    trained, start = load_reference(run).state_dict(), load_reference(imported).state_dict()
    for key, value in start.items():
        assert torch.equal(trained[key], value), key


def fairseq_weights(export: Path) -> dict[str, torch.Tensor]:
    """An export's state dict without fairseq's bookkeeping (versions, the sinusoids' placeholders)."""
    state = torch.load(export / "checkpoint.pt", weights_only=True)["model"]
    return {key: value for key, value in state.items() if not key.endswith(("version", "_float_tensor"))}


@pytest.mark.slow
def test_deepspeeds_recovery_scripts_in_a_save_dir_write_the_consolidated_weights(runs, exported, tmp_path):
    """DeepSpeed copies zero_to_fp32.py and zero_to_torch.py into every save_dir; on a pipeline checkpoint
    they failed ('NoneType' object has no attribute 'items': its mp_rank_00_model_states.pt holds module=None,
    the weights are in the layer files). The copies in a real save_dir now write what they promise,
    OUTPUT_DIR/pytorch_model.bin: one state dict of the whole model under fairseq's names, here the very
    tensors of the fairseq export (a Post-LN model folds nothing), in fp32 or the --dtype asked for."""
    run = runs / "post_ln"

    def script(name: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["python", name, ".", *args], cwd=run, capture_output=True, text=True, timeout=600)

    result = script("zero_to_fp32.py", str(tmp_path / "fp32"))
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    weights = fairseq_weights(exported["post_ln"])
    assert state.keys() == weights.keys()
    assert all(value.dtype == torch.float32 and torch.equal(value, weights[key]) for key, value in state.items())

    result = script("zero_to_torch.py", str(tmp_path / "bf16"), "--dtype", "bf16", "--tag", "global_step100")
    assert result.returncode == 0, result.stderr[-3000:]
    halved = torch.load(tmp_path / "bf16" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(value, weights[key].bfloat16()) for key, value in halved.items())
    for refused in (["--safe_serialization"], ["--max_shard_size", "1GB"]):
        result = script("zero_to_fp32.py", str(tmp_path / "refused"), *refused)
        assert result.returncode == 2 and result.stderr.startswith("fathom: error: "), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and refused[0] in result.stderr
    assert not (tmp_path / "refused").exists()


def write_fairseq_checkpoint(path: Path, data: Path) -> None:
    """What fairseq-train saves for a small untrained Post-LN transformer over `data`'s dictionaries: its
    args (model, task, where the data was) and its weights under fairseq's names."""
    corpus = PreparedData(data)
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, embed_dim=16, ffn_dim=32, attention_heads=2,
                      norm_scheme="post_ln", src_vocab_size=corpus.src_vocab_size,
                      tgt_vocab_size=corpus.tgt_vocab_size)  # fmt: skip
    state = Transformer(cfg).state_dict()  # fairseq's names, sinusoidal positions
    args = argparse.Namespace(**to_fairseq.fairseq_args(cfg))  # as fairseq-train saved them before 0.10
    args.task, args.data, args.source_lang, args.target_lang = "translation", str(data), corpus.src, corpus.tgt
    torch.save({"args": args, "model": {**state, "encoder.version": torch.tensor([3.0]),
                                        "decoder.version": torch.tensor([3.0])}}, path)  # fmt: skip


def test_a_run_from_an_imported_model_refuses_data_with_other_dictionaries(multi30k_slice, tmp_path):
    """An imported model's dictionaries were checked by size only: data prepared with a dictionary of the
    same size in another order trained silently against the wrong embeddings. The import records the
    dictionaries of the data the model was trained on, and a run starting from it (train.init_from)
    refuses other ones in one line before launch; data prepared with --spm-model and the import's
    dictionaries starts."""
    checkpoint, imported = tmp_path / "checkpoint_best.pt", tmp_path / "imported"
    write_fairseq_checkpoint(checkpoint, multi30k_slice)
    from_fairseq.main(["--fairseq-checkpoint", str(checkpoint), "--out", str(imported)])
    other = tmp_path / "other"  # two entries swapped: same sizes, other token ids
    shutil.copytree(multi30k_slice, other)
    edit_prepared(other, "dict.de.txt", lambda lines: [*lines[:10], lines[11], lines[10], *lines[12:]])

    def start(data: Path) -> None:
        overrides = [f"data.path={data}", f"train.save_dir={tmp_path / 'run'}", f"train.init_from={imported}",
                     "model.norm_scheme=post_ln", "model.encoder_layers=1", "model.decoder_layers=1",
                     "model.embed_dim=16", "model.ffn_dim=32", "model.attention_heads=2"]  # fmt: skip
        check_run(parse_train_args(["--config", str(ROOT / "ds_configs" / "default.json"), "--override", *overrides]),
                  world_size=2)  # fmt: skip

    with pytest.raises(ConfigError) as refused:
        start(other)
    message = str(refused.value)
    assert "\n" not in message and "dict.de.txt is not the dictionary" in message and str(imported) in message
    assert "--dict" in message  # says how to prepare data for it

    raw = tmp_path / "raw"
    raw.mkdir()
    splits = [write_slice(raw, name, lines) for name, lines in (("train", 400), ("val", 60))]
    prepared = tmp_path / "prepared"
    prepare_main(["--src", "de", "--tgt", "en", "--train", splits[0], "--valid", splits[1], "--spm-model",
                  str(multi30k_slice / "spm.model"), "--dict", str(imported / "dict.de.txt"),
                  str(imported / "dict.en.txt"), "--workers", "1", "--out", str(prepared)])  # fmt: skip
    start(prepared)
    start(multi30k_slice)  # the data the model was trained on
    with pytest.raises(ConfigError, match="dict.de.txt is not the dictionary"):
        check_vocab(imported, load_reference(imported).cfg, PreparedData(other))  # generate.py, translate.py


def failure(capsys, main, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # a progress bar may come first
    errors = [line for line in err if "error" in line.lower()]
    assert len(errors) == 1 and err[-1] == errors[0] and errors[0].startswith("fathom: error: "), err
    return errors[0]


def write_run_config(save_dir: Path, **model) -> Path:
    save_dir.mkdir(parents=True)
    model = {"encoder_layers": 2, "decoder_layers": 2, "src_vocab_size": 16, "tgt_vocab_size": 16, **model}
    (save_dir / "config.json").write_text(json.dumps({"model": model}))
    return save_dir


@pytest.mark.parametrize("scheme", [name for name, s in SCHEMES.items() if s.fairseq_layout is None])
def test_unexportable_scheme_is_refused(scheme, tmp_path, capsys, multi30k_slice):
    run = write_run_config(tmp_path / "run", norm_scheme=scheme)
    message = failure(
        capsys, to_fairseq.main, "--checkpoint", str(run), "--data", str(multi30k_slice), "--out", str(tmp_path / "out")
    )
    assert f"'{scheme}' cannot be exported" in message and "post_ln" in message
    assert not (tmp_path / "out").exists()


def test_bad_export_inputs_fail_in_one_line(tmp_path, capsys, multi30k_slice):
    out = tmp_path / "out"
    message = failure(
        capsys, to_fairseq.main, "--checkpoint", str(tmp_path), "--data", str(multi30k_slice), "--out", str(out)
    )
    assert "not a training directory" in message
    run = write_run_config(tmp_path / "run", norm_scheme="post_ln")
    message = failure(
        capsys, to_fairseq.main, "--checkpoint", str(run), "--data", str(multi30k_slice), "--out", str(out)
    )
    assert "no 'latest' file" in message
    message = failure(
        capsys,
        to_fairseq.main,
        "--checkpoint",
        str(run),
        "--tag",
        "global_step9",
        "--data",
        str(multi30k_slice),
        "--out",
        str(out),
    )
    assert "no checkpoint tagged 'global_step9'" in message
    assert not out.exists()
    message = failure(
        capsys, from_fairseq.main, "--fairseq-checkpoint", str(tmp_path / "missing.pt"), "--out", str(out)
    )
    assert "no such file" in message
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    message = failure(capsys, from_fairseq.main, "--fairseq-checkpoint", str(tmp_path / "junk.pt"), "--out", str(out))
    assert "not a loadable fairseq checkpoint" in message
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.pt", "run"]  # no staging left behind


@pytest.mark.slow
def test_bad_checkpoints_and_data_fail_in_one_line(runs, multi30k_slice, tmp_path, capsys):
    out = tmp_path / "out"
    wrong_data = tmp_path / "data"
    shutil.copytree(multi30k_slice, wrong_data)
    edit_prepared(wrong_data, "dict.de.txt", lambda lines: lines[:-8])
    message = failure(
        capsys, to_fairseq.main, "--checkpoint", str(runs / "post_ln"), "--data", str(wrong_data), "--out", str(out)
    )
    assert "dictionaries have" in message and "use the run's data directory" in message

    damaged = tmp_path / "damaged"
    shutil.copytree(runs / "post_ln", damaged)
    layer = damaged / "global_step100" / "layer_03-model_states.pt"
    layer.write_bytes(layer.read_bytes()[:100])
    message = failure(
        capsys, to_fairseq.main, "--checkpoint", str(damaged), "--data", str(multi30k_slice), "--out", str(out)
    )
    assert "layer_03-model_states.pt: " in message and "truncated" in message
    message = failure(capsys, to_fairseq.main, "--checkpoint", str(damaged), "--data", str(multi30k_slice),
                      "--out", str(damaged), "--force")  # fmt: skip
    assert f"--out {damaged}: is or holds the input {damaged}, which replacing it would delete" in message
    layer.unlink()
    message = failure(
        capsys, to_fairseq.main, "--checkpoint", str(damaged), "--data", str(multi30k_slice), "--out", str(out)
    )
    assert "layer files missing (first layer_03-model_states.pt)" in message

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    message = failure(
        capsys, to_fairseq.main, "--checkpoint", str(runs / "post_ln"), "--data", str(multi30k_slice), "--out", str(out)
    )
    assert "already exists" in message
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "data", "out"]  # no staging left behind


def test_every_model_field_is_a_fairseq_argument_or_says_how_it_converts():
    """The model section <-> fairseq's arguments was written three times (export, import, torchscale's peer)
    and no test walked ModelConfig's fields: a new field exported silently wrong. Now one table
    (convert/fairseq_arguments.py) holds each field, and the export's arguments read back to the same model."""
    from fathom.convert.fairseq_arguments import fairseq_arguments, read_arguments, unmapped_fields

    assert unmapped_fields() == []
    cfg = ModelConfig(encoder_layers=3, decoder_layers=2, embed_dim=24, ffn_dim=40, attention_heads=3, dropout=0.2,
                      attention_dropout=0.05, activation_dropout=0.15, max_positions=77, learned_pos=True,
                      src_vocab_size=50, tgt_vocab_size=60)  # fmt: skip
    read = read_arguments(fairseq_arguments(cfg), Path("checkpoint.pt"))
    assert read == {field: getattr(cfg, field) for field in read}
