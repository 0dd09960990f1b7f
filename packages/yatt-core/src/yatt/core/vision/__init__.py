"""The vision family: what a vision-language model needs beyond text, in one home.

    _vision_model    VisionModel: whether a model takes images, its image token, the tokens
                     that end a response, read from the model's own config (nothing else does)
    _vision_inputs   a prompt's images processed once into pixels + grids that travel with it
    _row_images      a row's image files, opened with size and type checks
    _vision_forward  the policy's forward with images (Qwen2-VL, Qwen2.5-VL)
    _vision_cost     the vision tower's share of a sample's cost, for balancing

It imports the cost family and nothing above it.
"""

__all__: list[str] = []  # a family folder: its public names are yatt.core's
