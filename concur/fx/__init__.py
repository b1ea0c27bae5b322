"""The unfused path: ``concur.optimize`` and ``concur.inspect``. A model is traced with torch.fx,
annotated, turned into a DAG, scheduled, and compiled back into an fx module whose forward
switches streams and records and waits on events; the generated code is verified before it runs.
"""
