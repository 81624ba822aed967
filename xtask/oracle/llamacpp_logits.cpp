// Logits of a GGUF model for a fixed token sequence, through llama.cpp's public API, for
// `cargo xtask oracle-llamacpp`.
//
// The sequence runs twice in fresh state: once as a single batch (the logits written) and once
// a token at a time; the two must agree, which shows the recurrent (KDA) and cached (MLA) paths
// give what prefill gives. Flash attention is off and the KV cache is F32, because the CPU
// flash-attention path and an F16 cache move logits by ~4e-3.
//
// usage: llamacpp_logits MODEL.gguf OUT.f32 TOKEN[,TOKEN...] [THREADS]
// OUT.f32: row t = logits after consuming token t, n_vocab little-endian f32 per row.
// stdout: one `key: value` line per fact (n_vocab, max_abs, max_rel_step_vs_batch, ...).

#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// Batch and step-by-step logits must agree to this, relative to the largest |logit| of the
// row (a per-element relative test would fail on logits that are near zero by chance).
constexpr double kMaxRelStepVsBatch = 1e-4;

[[noreturn]] void die(const std::string & message) {
    std::fprintf(stderr, "llamacpp_logits: %s\n", message.c_str());
    std::exit(1);
}

std::vector<llama_token> parse_tokens(const char * text) {
    std::vector<llama_token> tokens;
    const char * p = text;
    while (*p != '\0') {
        char * end = nullptr;
        const long value = std::strtol(p, &end, 10);
        if (end == p || value < 0) {
            die(std::string("bad token list: ") + text);
        }
        tokens.push_back(static_cast<llama_token>(value));
        p = (*end == ',') ? end + 1 : end;
        if (*end != ',' && *end != '\0') {
            die(std::string("bad token list: ") + text);
        }
    }
    if (tokens.empty()) {
        die("empty token list");
    }
    return tokens;
}

void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        std::fputs(text, stderr);
    }
}

llama_context * fresh_context(llama_model * model, uint32_t n_ctx, int n_threads) {
    llama_context_params params = llama_context_default_params();
    params.n_ctx = n_ctx;
    params.n_batch = n_ctx;
    params.n_ubatch = n_ctx;
    params.n_seq_max = 1;
    params.n_threads = n_threads;
    params.n_threads_batch = n_threads;
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    params.type_k = GGML_TYPE_F32;
    params.type_v = GGML_TYPE_F32;
    params.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, params);
    if (ctx == nullptr) {
        die("cannot create a context");
    }
    return ctx;
}

// Decodes tokens[first, first + count) at their positions, asking for every position's logits,
// and appends those rows to `out`.
void decode(llama_context * ctx, const std::vector<llama_token> & tokens, size_t first,
            size_t count, int32_t n_vocab, std::vector<float> & out) {
    llama_batch batch = llama_batch_init(static_cast<int32_t>(count), 0, 1);
    for (size_t i = 0; i < count; ++i) {
        batch.token[i] = tokens[first + i];
        batch.pos[i] = static_cast<llama_pos>(first + i);
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = static_cast<int32_t>(count);
    const int32_t status = llama_decode(ctx, batch);
    if (status != 0) {
        die("llama_decode returned " + std::to_string(status) + " at position " +
            std::to_string(first));
    }
    for (size_t i = 0; i < count; ++i) {
        const float * row = llama_get_logits_ith(ctx, static_cast<int32_t>(i));
        if (row == nullptr) {
            die("no logits for position " + std::to_string(first + i));
        }
        out.insert(out.end(), row, row + n_vocab);
    }
    llama_batch_free(batch);
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 4 || argc > 6) {
        die("usage: llamacpp_logits MODEL.gguf OUT.f32 TOKEN[,TOKEN...] [THREADS [MAX_REL]]");
    }
    const char * model_path = argv[1];
    const char * out_path = argv[2];
    const std::vector<llama_token> tokens = parse_tokens(argv[3]);
    const int n_threads = argc >= 5 ? std::atoi(argv[4]) : 2;
    const double max_rel_limit = argc == 6 ? std::atof(argv[5]) : kMaxRelStepVsBatch;

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params model_params = llama_model_default_params();
    model_params.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path, model_params);
    if (model == nullptr) {
        die(std::string("cannot load ") + model_path);
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (const llama_token token : tokens) {
        if (token >= n_vocab) {
            die("token " + std::to_string(token) + " is not below n_vocab " +
                std::to_string(n_vocab));
        }
    }
    const size_t n_tokens = tokens.size();
    const uint32_t n_ctx = static_cast<uint32_t>(n_tokens < 64 ? 64 : n_tokens);

    std::vector<float> batch_logits;
    {
        llama_context * ctx = fresh_context(model, n_ctx, n_threads);
        decode(ctx, tokens, 0, n_tokens, n_vocab, batch_logits);
        llama_free(ctx);
    }
    std::vector<float> step_logits;
    {
        llama_context * ctx = fresh_context(model, n_ctx, n_threads);
        for (size_t t = 0; t < n_tokens; ++t) {
            decode(ctx, tokens, t, 1, n_vocab, step_logits);
        }
        llama_free(ctx);
    }

    double max_abs = 0.0;
    double max_abs_diff = 0.0;
    double max_rel = 0.0;
    bool finite = true;
    for (size_t t = 0; t < n_tokens; ++t) {
        double row_max = 0.0;
        double row_diff = 0.0;
        for (int32_t v = 0; v < n_vocab; ++v) {
            const size_t i = t * static_cast<size_t>(n_vocab) + static_cast<size_t>(v);
            finite = finite && std::isfinite(batch_logits[i]) && std::isfinite(step_logits[i]);
            row_max = std::fmax(row_max, std::fabs(batch_logits[i]));
            row_diff = std::fmax(row_diff, std::fabs(static_cast<double>(batch_logits[i]) -
                                                     static_cast<double>(step_logits[i])));
        }
        max_abs = std::fmax(max_abs, row_max);
        max_abs_diff = std::fmax(max_abs_diff, row_diff);
        max_rel = std::fmax(max_rel, row_max > 0.0 ? row_diff / row_max : row_diff);
    }

    std::FILE * out = std::fopen(out_path, "wb");
    if (out == nullptr) {
        die(std::string("cannot create ") + out_path);
    }
    // ggml runs only on little-endian hosts here, so the floats go out as they are in memory.
    const size_t written = std::fwrite(batch_logits.data(), sizeof(float), batch_logits.size(), out);
    if (written != batch_logits.size() || std::fclose(out) != 0) {
        die(std::string("cannot write ") + out_path);
    }

    std::printf("n_tokens: %zu\n", n_tokens);
    std::printf("n_vocab: %d\n", n_vocab);
    std::printf("max_abs: %.9g\n", max_abs);
    std::printf("max_abs_step_vs_batch: %.9g\n", max_abs_diff);
    std::printf("max_rel_step_vs_batch: %.9g\n", max_rel);
    std::printf("row0_head:");
    for (int32_t v = 0; v < 8 && v < n_vocab; ++v) {
        std::printf(" %.9g", batch_logits[static_cast<size_t>(v)]);
    }
    std::printf("\n");

    llama_model_free(model);
    llama_backend_free();

    if (!finite) {
        die("non-finite logits");
    }
    if (max_rel > max_rel_limit) {
        die("step-by-step logits differ from batch logits: max relative difference " +
            std::to_string(max_rel) + " over the limit " + std::to_string(max_rel_limit));
    }
    return 0;
}
