"""The ``torch.compile`` backend ``"concur"``: inductor compiles and fuses each graph whole, and
concur puts the fused kernels on streams, by rewriting the generated wrapper's ``call`` or
by stamping streams onto the aten graph for inductor's own stream support (torch >= 2.13).
"""
