/* Q4_K, Q5_K and Q6_K (ggml-common.h's layouts: super-blocks of 256), multiplied with
 * activations in Q8_K as llama.cpp does. */
#include "llmcli_cpu.h"

/* Not written yet: llmcli keeps its torch path for these types. */
const weight_type TYPE_Q4_K = { QK_K, 144, T_Q8_K, 0, 0 };
const weight_type TYPE_Q5_K = { QK_K, 176, T_Q8_K, 0, 0 };
const weight_type TYPE_Q6_K = { QK_K, 210, T_Q8_K, 0, 0 };
