"""The planning tool: a training step compiled from abstract arrays (plan.py), ranked across layouts and meshes
(compare.py), costed from its HLO (hlo_cost.py) against a chip's table (chips.py) as a roofline (roofline.py).
Its figures are predictions, not measurements (design §13)."""
