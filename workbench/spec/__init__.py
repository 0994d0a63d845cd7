"""What a run is, before anything runs: the recipe's schema and rules, data formats, chat templates, layouts,
adapter initialisations, RoPE scaling and the catalogue of model configs."""
