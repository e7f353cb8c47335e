"""Decision protocols: TypeSafe System One (POST /v1/systemone) and vLLM Decisions (POST /v1/decisions).

Both decode their JSON into `helios.serving.decisions.DecisionQuestion` records, run the one shared
scorer, and encode its raw label probabilities in their own answer shapes.
"""
