"""Weight quantization: the modules a quantized layer runs as, and the pass that puts them in.

    apply.py        the pass. After the loader fills the model (kiln/models/loader.py),
                    `quantize_model` walks its linears and picks one module per layer: the
                    GGUF's own blocks where the file stored them in a type the kernels read
                    (gguf_blocks.KQuantLinear), else int4 / int8 (linear.Int4Linear,
                    Int8Linear; GGUF Q4_0/Q4_1 arrive as GroupQuant and are repacked exactly).
                    It also picks the head's form, cuts a draft head (`head_rows`) and, under
                    --batch-invariant, fixes each layer's kernel (`fix_kernel_choice`).
    linear.py       the weight-only int8 / int4 linear modules (gpt-fast style) and their
                    packing for kiln's CPU kernels or PyTorch's; QuantizedLinear, the base the
                    pass and gguf_blocks.py share; Int8Embedding (a tied embedding under int8 rows).
    gguf_blocks.py  a GGUF's Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K blocks run as the file stores them
                    (no second rounding): KQuantLinear over kernels/kquant.cpp's kq_linear,
                    repacked once into 8-row tiles (`pack` / `unpack`), and BlockEmbedding,
                    whose rows are dequantized per lookup. The loader builds a BlockEmbedding
                    itself; the linears reach here through apply.py.

    loader -> apply.quantize_model -> per layer: gguf_blocks.KQuantLinear | linear.Int4Linear
                                                 | linear.Int8Linear   (all QuantizedLinear)

Imports run one way: apply.py and gguf_blocks.py import linear.py, never the reverse, and
this file imports none of them (callers name the module they use, so importing one pays for
no other).
"""
