"""What both paths share: the facts of each operation (storages read and written, RNG, FLOPs,
bytes), the dependency DAG with its hazard edges, and what each operation costs.
"""
