"""Quantization algorithms, apart from the op wrappers (_functions.py) and the layers (nn):

    weights.py             quantize_weight (int8 per channel), quantize_weight_int4 (int4 per group: round-to-nearest,
                           or GPTQ given the inputs' second moment); w8a8_cpu re-exports both
    grid.py                the int4 round-to-nearest grids, their range search and fp16 steps
    gptq.py, refit.py      GPTQ on one weight matrix, and its least-squares scale refit
    gptq_layers.py         quantize_model's GPTQ: each layer's second moment from one calibration run
    calibration.py         the one calibration runner (input rule, hooks) every algorithm here measures with
    smoothquant.py         SmoothQuant: statistics, scales and folding (smooth_quant, calibrate_smoothing)
    smoothquant_pairs.py   which producer / consumer pairs SmoothQuant folds, per architecture
    static_activations.py  static activation scales from calibration (calibrate_static_activations)

w8a8_cpu.llm re-exports smooth_quant, calibrate_smoothing, SmoothingReport and calibrate_static_activations."""
