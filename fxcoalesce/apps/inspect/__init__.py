"""``fxcoalesce inspect``: "what would fxcoalesce do to this model, at this TP degree?",
answered at full size under fake tensors and a fake process group (no weights, no GPU).

Three front doors, one report (the one the backend writes for every graph it compiles):

    --model NAME                       the zoo (``fxcoalesce.models``; ``apps.trace``)
    --model pkg.mod:fn | file.py:fn    the user's own factory (``factory``)
    --hf NAME | config.json            a Hugging Face architecture, sharded by its own TP plan
                                       as ``from_pretrained(tp_plan="auto")`` shards it (``hf``)

``profiles`` predicts the step's communication with each cost profile, labelled with where
and how it was measured; ``command`` prints the table.
"""
