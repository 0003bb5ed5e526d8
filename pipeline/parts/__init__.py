"""The model's parts in their pipeline form: the pipe classes (stage_modules), the flat list of LayerSpecs
(specs) and where the stages are cut (stage_cuts)."""
