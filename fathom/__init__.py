"""fathom: extremely deep encoder-decoder Transformers for machine translation on DeepSpeed's pipeline engine.

Its packages live in the repository's top-level folders (model/, pipeline/, corpus/, ...) and install as
fathom.model, fathom.pipeline, fathom.corpus, ... (setup.cfg's package_dir)."""
