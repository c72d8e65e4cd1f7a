"""The vision encoder build stage (issue #46 item 3), in its own folder: it uses the vision library
(:mod:`pipeline.vision`), the model sources (:mod:`pipeline.quantize.sources`) and the recipe, which themselves import
:mod:`pipeline.vision` — a stage inside ``pipeline/vision`` would close a circle between those folders."""
