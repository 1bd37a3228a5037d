/* Q2_K, Q3_K and IQ4_XS (ggml-common.h's layouts: super-blocks of 256), multiplied with
 * activations in Q8_K as llama.cpp does. */
#include "llmcli_cpu.h"

/* Not written yet: llmcli keeps its torch path for these types. */
const weight_type TYPE_Q2_K = { QK_K, 84, T_Q8_K, 0, 0 };
const weight_type TYPE_Q3_K = { QK_K, 110, T_Q8_K, 0, 0 };
const weight_type TYPE_IQ4_XS = { QK_K, 136, T_Q8_K, 0, 0 };
