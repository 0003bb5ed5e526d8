"""The papers' recipes (ds_configs/papers/, docs/RECIPES.md): each holds its paper's settings, transcribed
here from the papers (../shared/papers), so that a recipe cannot drift from its paper; each trains and
translates."""

import json

import pytest

from fathom.pipeline.config.config_file import PAPERS, config_file, shipped_configs
from fathom.translation.scoring import tokenized_bleu
from fathom.translation.translator import Translator
from tests.helpers import ROOT, launch, logged_steps

# BranchNorm (Liu, Zeng, Meng, Zhou), Appendix B, Table 4, for every scale: the learning rate, its schedule
# and warmup, tokens per update ("Max tokens 128 x 4096"), Adam, label smoothing, updates, clipping, weight
# decay and the Transformer-base shape; Sec. 4.2: T = 4000 "for all experiments".
TABLE_4 = {
    "optimizer": "Adam",
    "lr": 5e-4,
    "schedule": "inverse_sqrt",
    "warmup_updates": 4000,
    "warmup_init_lr": 1e-7,
    "tokens_per_update": 128 * 4096,
    "adam_betas": [0.9, 0.98],
    "adam_eps": 1e-8,
    "label_smoothing": 0.1,
    "updates": 100_000,
    "epochs": None,
    "clip_norm": 0.0,
    "weight_decay": 0.0001,
    "embed_dim": 512,
    "ffn_dim": 2048,
    "attention_heads": 8,
}
SMALL, MEDIUM = {"dropout": 0.4}, {"dropout": 0.2}  # Table 4's dropout: WMT17 En-De, WMT14 En-Fr
BRANCHNORM = {"norm_scheme": "branchnorm", "T": 4000}


# Very Deep Transformers (Liu, Duh, Liu, Gao), Sec. 4 and footnotes 8-9: fairseq's Transformer base, RAdam;
# En-De: peak lr 1e-3 after 4,000 warmup steps, En-Fr: 7e-4 after 8,000; at most 50 epochs; 3,584 tokens a
# batch on each GPU, of 16 V100s for 60L-12L and 4 for 6L-6L (stated for En-Fr; assumed for En-De).
VERY_DEEP = {"optimizer": "RAdam", "schedule": "inverse_sqrt", "epochs": 50, "embed_dim": 512, "ffn_dim": 2048,
             "attention_heads": 8, "norm_scheme": "admin"}  # fmt: skip
VERY_DEEP_PAIRS = {"de": {"lr": 1e-3, "warmup_updates": 4000}, "fr": {"lr": 7e-4, "warmup_updates": 8000}}
# Not in the paper, which "adopts the hyper-parameters ... as implemented in FAIRSEQ": fairseq's for its
# transformer and inverse_sqrt schedule, which the recipes pick (docs/RECIPES.md)
FAIRSEQS = {"warmup_init_lr": 1e-7, "adam_betas": [0.9, 0.98], "adam_eps": 1e-8, "label_smoothing": 0.1,
            "clip_norm": 0.0, "weight_decay": 0.0, "dropout": 0.1, "updates": 10_000_000}  # fmt: skip


def row(scale: dict, scheme: dict, depth: tuple[int, int]) -> dict:
    return {**TABLE_4, **scale, **scheme, "layers": list(depth)}


def very_deep_row(pair: str, depth: tuple[int, int], gpus: int) -> dict:
    return {**FAIRSEQS, **VERY_DEEP, **VERY_DEEP_PAIRS[pair], "tokens_per_update": 3584 * gpus, "layers": list(depth)}


PAPER_ROWS = {
    # BranchNorm, Table 1 (WMT17 En-De, newstest2014; BranchNorm's row): 29.3, 30.3, 30.7, 29.8, 29.6 BLEU
    **{f"branchnorm_table1_wmt17_en_de_{n}L-{n}L": row(SMALL, BRANCHNORM, (n, n)) for n in (6, 18, 50, 100, 250)},
    # BranchNorm, Table 2 (WMT14 En-Fr): 41.67, 43.53, 43.89, 44.20, 44.30, 44.27 BLEU
    **{f"branchnorm_table2_wmt14_en_fr_{n}L-{n}L": row(MEDIUM, BRANCHNORM, (n, n)) for n in (6, 18, 50, 100, 250, 500)},
    # DeepNet's 100L-100L on WMT17 En-De (28.9 BLEU, BranchNorm's Table 1 row "DeepNorm (Wang et al., 2022a)"),
    # with the settings under which BranchNorm reproduced it (its row DeepNorm†, 29.3): DeepNet's own are not
    # in the papers this project has.
    "deepnet_wmt17_en_de_100L-100L": row(SMALL, {"norm_scheme": "deepnorm"}, (100, 100)),
    # Very Deep Transformers, Table 1, rows 6L-6L ADMIN (41.5 En-Fr, 27.7 En-De) and 60L-12L ADMIN (43.8, 30.1)
    **{f"admin_wmt14_en_{pair}_6L-6L": very_deep_row(pair, (6, 6), gpus=4) for pair in ("de", "fr")},
    **{f"admin_wmt14_en_{pair}_60L-12L": very_deep_row(pair, (60, 12), gpus=16) for pair in ("de", "fr")},
}


def settings(recipe: dict) -> dict:
    """A recipe's values under the names of the papers' tables."""
    optimizer, scheduler = recipe["optimizer"]["params"], recipe["scheduler"]
    model, train = recipe["model"], recipe["train"]
    assert scheduler["params"]["warmup_max_lr"] == optimizer["lr"], "the schedule's peak is the optimizer's lr"
    found = {
        "optimizer": recipe["optimizer"]["type"],
        "lr": optimizer["lr"],
        "schedule": {"InverseSqrtLR": "inverse_sqrt"}.get(scheduler["type"], scheduler["type"]),
        "warmup_updates": scheduler["params"]["warmup_num_steps"],
        "warmup_init_lr": scheduler["params"]["warmup_min_lr"],
        # micro-batches of data.max_tokens, train_batch_size / micro-batch size of them per update
        "tokens_per_update": recipe["data"]["max_tokens"]
        * recipe["train_batch_size"]
        // recipe["train_micro_batch_size_per_gpu"],
        "adam_betas": optimizer["betas"],
        "adam_eps": optimizer["eps"],
        "label_smoothing": train["label_smoothing"],
        "updates": train["max_steps"],
        "epochs": train.get("max_epochs"),
        "clip_norm": recipe["gradient_clipping"],
        "weight_decay": optimizer["weight_decay"],
        "layers": [model["encoder_layers"], model["decoder_layers"]],
        **{key: model[key] for key in ("embed_dim", "ffn_dim", "attention_heads", "dropout", "norm_scheme")},
    }
    if model["norm_scheme"] == "branchnorm":
        assert model["branchnorm"]["growth"] == "linear", "Eq. 8: alpha_t = min(1, t / T)"
        found["T"] = model["branchnorm"]["T"]
    return found


def recipe(name: str) -> dict:
    return json.loads(config_file(name).read_text())


def test_every_recipe_is_a_row_of_a_papers_table():
    assert shipped_configs(PAPERS) == sorted(PAPER_ROWS)
    assert all(config_file(name).parent == ROOT / "ds_configs" / PAPERS for name in PAPER_ROWS)


@pytest.mark.parametrize("name", sorted(PAPER_ROWS))
def test_a_recipe_holds_its_papers_settings(name):
    assert settings(recipe(name)) == PAPER_ROWS[name]


@pytest.mark.slow
def test_every_recipe_trains_two_steps_and_translates(tmp_path, multi30k_slice):
    """Each recipe with its depth and width overridden down, on a Multi30k slice, on one rank: 2 updates of 2
    micro-batches, then its checkpoint translates test sentences and scores them."""
    small = ["model.encoder_layers=2", "model.decoder_layers=2", "model.embed_dim=32", "model.ffn_dim=64",
             "model.attention_heads=2", f"data.path={multi30k_slice}", "data.max_tokens=256", "train_batch_size=2",
             "train.max_steps=2", "train.log_interval=1"]  # fmt: skip
    sources = (multi30k_slice / "test.raw.de").read_text().splitlines()[:4]
    references = (multi30k_slice / "test.raw.en").read_text().splitlines()[:4]
    for name in sorted(PAPER_ROWS):
        save_dir = tmp_path / name
        job = launch(ROOT / "scripts" / "train.py", "--config", name, "--override", *small,
                     f"train.save_dir={save_dir}", processes=1)  # fmt: skip
        assert job.returncode == 0, name
        assert [step["step"] for step in logged_steps(save_dir) if "lr" in step] == [1, 2]
        translations = Translator.from_checkpoint(save_dir, multi30k_slice, device="cpu").translate(sources)
        assert len(translations) == 4
        assert tokenized_bleu(translations, references, "en").startswith("tokenized BLEU = ")
