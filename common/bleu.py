"""sacreBLEU's BLEU as its command scores a target language: `sacrebleu -l SRC-TGT` tokenizes Chinese with
its `zh` tokenizer, Japanese with `ja-mecab` and Korean with `ko-mecab`, every other language with `13a`.
13a does not segment those scripts, so a hypothesis one character off its reference scored 0."""

from __future__ import annotations

from sacrebleu.metrics import BLEU

from fathom.common.errors import ConfigError

# sacreBLEU's tokenizer for each target language it does not score with 13a, and the extra it needs
TOKENIZERS = {"zh": "zh", "ja": "ja-mecab", "ko": "ko-mecab"}
EXTRAS = {"ja-mecab": "sacrebleu[ja]", "ko-mecab": "sacrebleu[ko]"}


def bleu_tokenizer(lang: str | None) -> str:
    """The tokenizer sacreBLEU's command picks for target language `lang` (None: not a language, 13a)."""
    return TOKENIZERS.get(lang or "", "13a")


def bleu_metric(lang: str | None, **options: object) -> BLEU:
    """sacreBLEU's BLEU for target language `lang`; its signature names the tokenizer. A tokenizer whose
    extra is not installed is one line naming it."""
    tokenize = bleu_tokenizer(lang)
    try:
        return BLEU(tokenize=tokenize, trg_lang=lang or "", **options)
    except RuntimeError:  # sacreBLEU's word for a missing MeCab
        raise ConfigError(
            f"BLEU for {lang}: sacreBLEU tokenizes it with {tokenize}, which needs {EXTRAS[tokenize]}: "
            f"pip install '{EXTRAS[tokenize]}'"
        ) from None


def corpus_bleu(hypotheses: list[str], references: list[str], lang: str | None) -> float:
    """sacreBLEU's corpus BLEU of `hypotheses` against one reference each, as its command scores `lang`: the
    number validation (train.valid_bleu) and the depth study compare."""
    return bleu_metric(lang).corpus_score(hypotheses, [references]).score
