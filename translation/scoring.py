"""How translations are scored, both ways the papers score them, from the same hypotheses and references:

- sacreBLEU's BLEU and chrF on detokenized text, cased, tokenized as sacreBLEU's command does for the
  target language (13a; zh, ja-mecab, ko-mecab: common/bleu.py), with sacreBLEU's signature (Post, 2018);
- tokenized BLEU, as the WMT depth papers report it (BranchNorm, DeepNet, Very Deep Transformers, all
  trained with fairseq): BLEU of multi-bleu.perl (cased, 4-grams, one reference, no smoothing) on text
  tokenized as fairseq's prepare-wmt14en2de.sh and prepare-wmt14en2fr.sh tokenize the test set (curly
  apostrophes made straight, the Moses tokenizer with -a, which splits hyphens: "Kaffee @-@ Automat"),
  and for German, compounds split as fairseq's compound_split_bleu.sh then splits them ("Kaffee @
  ##AT##-##AT## @ Automat"). Its numbers depend on the tokenization, which is why sacreBLEU exists; they
  are the numbers the papers' tables compare.
"""

from __future__ import annotations

import re
from typing import TextIO

from sacrebleu.metrics import BLEU, CHRF
from sacremoses import MosesTokenizer

from fathom.common.bleu import TOKENIZERS, bleu_metric, bleu_tokenizer

COMPOUND = re.compile(r"(\S)-(\S)")
# The target languages whose tokenized BLEU splits compounds: the papers' WMT En-De
SPLIT_COMPOUNDS = frozenset({"de"})


def split_compounds(line: str) -> str:
    """Every hyphen between two non-blanks as its own token, as the scripts' perl s{(\\S)-(\\S)}{...}g:
    matches do not overlap, so in "a-b-c" only the first hyphen splits."""
    return COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def tokenized(lines: list[str], lang: str) -> list[str]:
    """As fairseq's WMT scripts tokenize a test set (tokenizer.perl -a -l LANG; no escaping, which maps
    tokens one to one), compounds split where the target is German."""
    tokenizer = MosesTokenizer(lang=lang)
    out = [
        tokenizer.tokenize(line.replace("\u2019", "'"), aggressive_dash_splits=True, return_str=True, escape=False)
        for line in lines
    ]
    return [split_compounds(line) for line in out] if lang in SPLIT_COMPOUNDS else out


def tokenized_bleu(hypotheses: list[str], references: list[str], lang: str) -> str:
    """multi-bleu.perl's line for detokenized `hypotheses` against `references` in language `lang`, with
    what was done to the text before it was scored. Moses does not segment Chinese, Japanese or Korean:
    those are tokenized as sacreBLEU tokenizes them (common/bleu.py)."""
    if lang in TOKENIZERS:
        score = bleu_metric(lang, smooth_method="none").corpus_score(hypotheses, [references])
        how = f"sacreBLEU's {bleu_tokenizer(lang)} tokenizer, multi-bleu"
    else:
        score = BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(
            tokenized(hypotheses, lang), [tokenized(references, lang)]
        )
        how = "moses tokenizer -a" + (", compounds split" if lang in SPLIT_COMPOUNDS else "") + ", multi-bleu"
    p1, p2, p3, p4 = score.precisions
    return (
        f"tokenized BLEU = {score.score:.2f}, {p1:.1f}/{p2:.1f}/{p3:.1f}/{p4:.1f} (BP={score.bp:.3f}, "
        f"ratio={score.sys_len / max(score.ref_len, 1):.3f}, hyp_len={score.sys_len}, ref_len={score.ref_len}) "
        f"[{how}, {lang}]"
    )


def print_scores(hypotheses: list[str], references: list[str], lang: str, file: TextIO) -> None:
    """The tokenized BLEU, then sacreBLEU's BLEU and chrF, its signature last."""
    print(tokenized_bleu(hypotheses, references, lang), file=file)
    bleu, chrf = bleu_metric(lang), CHRF()
    for line in (bleu.corpus_score(hypotheses, [references]), chrf.corpus_score(hypotheses, [references])):
        print(line, file=file)
    print(bleu.get_signature(), file=file)
