// ggml's GEMV (one token times a weight matrix) out of cache, for `cargo xtask bench-peers
// --kernels`: the kernel-level peer of our MXFP4 and BF16 GEMV.
//
// A ring of distinct weight matrices, together far larger than the L3, is multiplied by one
// f32 activation vector in ONE graph with one mul_mat node per matrix, as a decode graph reads
// each weight once. The graph runs on a persistent, pinned threadpool with a preallocated work
// buffer, so thread start-up and allocation are not timed; what is timed is what llama.cpp
// pays per token: converting the activations to the vec_dot type (Q8_0 for MXFP4, BF16 for
// BF16) in every node, the dot products and the barriers between nodes.
//
// The weights are either plain ggml tensors (`plain`: mul_mat runs ggml_vec_dot_mxfp4_q8_0 or
// ggml_vec_dot_bf16 row by row) or, for MXFP4, in the CPU backend's CPU_REPACK buffer
// (`repack`: interleaved 8 rows at a time and run by ggml_gemv_mxfp4_8x8_q8_0), which is what
// llama.cpp does with CPU weights by default (`use_extra_bufts`, llama-bench's `--repack 1`).
//
// usage: ggml_gemv mxfp4|bf16 ROWS COLS THREADS RING MIN_MS plain|repack
// stdout: `features ...` (what libggml-cpu was compiled for), `gbps G` (weight bytes of the
// whole ring times repeats over seconds; MXFP4 counts 17 bytes per 32 weights, the bytes our
// kernels read too), `checksum S` (sum of the first node's output, to show it computed),
// `row0_error E` (its first row against a reference decoded here, relative to sum |w x|).

#define _GNU_SOURCE

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE_PAGE (2u << 20)

static uint64_t splitmix64(uint64_t * state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

static long parse_positive(const char * text, const char * what) {
    char * end = NULL;
    long value = strtol(text, &end, 10);
    if (end == text || *end != '\0' || value <= 0) {
        fprintf(stderr, "%s must be a positive integer, got %s\n", what, text);
        exit(2);
    }
    return value;
}

// Random codes that decode to finite values: random E2M1 nibbles and E8M0 scales 118..126
// (2^-9 .. 2^-1, the range of real experts), so no block is NaN (0xFF) or overflows.
static void fill_mxfp4(uint8_t * bytes, size_t len, uint64_t * rng) {
    for (size_t i = 0; i < len; i += 8) {
        uint64_t word = splitmix64(rng);
        size_t n = len - i < 8 ? len - i : 8;
        memcpy(bytes + i, &word, n);
    }
    // block_mxfp4 is { uint8_t e; uint8_t qs[16]; }: the scale is the first byte of 17.
    for (size_t block = 0; block < len / 17; block++) {
        bytes[17 * block] = (uint8_t) (118 + bytes[17 * block] % 9);
    }
}

// Random BF16 of magnitude 2^-7 .. 2^-4 (about 0.008 .. 0.06) built on the bits: random sign
// and mantissa, exponent 120..122, so no value is subnormal, infinite or NaN.
static void fill_bf16(uint8_t * bytes, size_t len, uint64_t * rng) {
    uint16_t * values = (uint16_t *) bytes;
    size_t count = len / 2;
    for (size_t i = 0; i < count; i += 4) {
        uint64_t word = splitmix64(rng);
        for (size_t j = 0; j < 4 && i + j < count; j++) {
            uint16_t r = (uint16_t) (word >> (16 * j));
            uint16_t exponent = (uint16_t) (120 + (r >> 7) % 3);
            values[i + j] = (uint16_t) ((r & 0x807F) | (exponent << 7));
        }
    }
}

// |y0 - y0_ref| / sum_c |w_0c x_c| for the first row of a matrix, the reference decoded here
// from the format's definition in double precision; ggml's activation rounding (Q8_0 or BF16)
// keeps this below 1e-3, a misread layout would make it order 1.
static double first_row_error(enum ggml_type type, const uint8_t * row, const float * x,
                              int64_t cols, float y0) {
    static const double e2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
    double sum = 0.0, magnitude = 0.0;
    for (int64_t c = 0; c < cols; c++) {
        double w;
        if (type == GGML_TYPE_MXFP4) {
            const uint8_t * block = row + 17 * (c / 32);
            int j = (int) (c % 32);
            // Element j < 16 is the low nibble of qs[j], element 16 + j the high one.
            uint8_t nibble = j < 16 ? (block[1 + j] & 0x0F) : (block[1 + j - 16] >> 4);
            w = ldexp(1.0, block[0] - 127) * e2m1[nibble & 7] * ((nibble & 8) ? -1.0 : 1.0);
        } else {
            uint16_t bits;
            memcpy(&bits, row + 2 * c, 2);
            uint32_t widened = (uint32_t) bits << 16;
            float f;
            memcpy(&f, &widened, 4);
            w = f;
        }
        sum += w * x[c];
        magnitude += fabs(w * x[c]);
    }
    return fabs((double) y0 - sum) / magnitude;
}

// The CPU backend's CPU_REPACK buffer type, found as llama.cpp finds it: through the CPU
// registry's `ggml_backend_dev_get_extra_bufts`.
static ggml_backend_buffer_type_t repack_buffer_type(void) {
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_get_extra_bufts_t get_extra_bufts = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra_bufts == NULL) {
        return NULL;
    }
    for (ggml_backend_buffer_type_t * buft = get_extra_bufts(ggml_backend_reg_dev_get(reg, 0));
         buft != NULL && *buft != NULL; buft++) {
        if (strcmp(ggml_backend_buft_name(*buft), "CPU_REPACK") == 0) {
            return *buft;
        }
    }
    return NULL;
}

// Advises [start, start + len) into transparent huge pages (the part that is page-aligned).
static void advise_huge(void * start, size_t len) {
    uintptr_t first = ((uintptr_t) start + 4095) / 4096 * 4096;
    uintptr_t end = (uintptr_t) start + len;
    if (end > first) {
        madvise((void *) first, end - first, MADV_HUGEPAGE);
    }
}

int main(int argc, char ** argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s mxfp4|bf16 ROWS COLS THREADS RING MIN_MS plain|repack\n",
                argv[0]);
        return 2;
    }
    enum ggml_type type;
    if (strcmp(argv[1], "mxfp4") == 0) {
        type = GGML_TYPE_MXFP4;
    } else if (strcmp(argv[1], "bf16") == 0) {
        type = GGML_TYPE_BF16;
    } else {
        fprintf(stderr, "weight type must be mxfp4 or bf16, got %s\n", argv[1]);
        return 2;
    }
    const int64_t rows = parse_positive(argv[2], "ROWS");
    const int64_t cols = parse_positive(argv[3], "COLS");
    const int threads = (int) parse_positive(argv[4], "THREADS");
    const int ring = (int) parse_positive(argv[5], "RING");
    const double min_seconds = 1e-3 * (double) parse_positive(argv[6], "MIN_MS");
    bool repack;
    if (strcmp(argv[7], "plain") == 0) {
        repack = false;
    } else if (strcmp(argv[7], "repack") == 0) {
        repack = true;
    } else {
        fprintf(stderr, "layout must be plain or repack, got %s\n", argv[7]);
        return 2;
    }
    if (cols % ggml_blck_size(type) != 0) {
        fprintf(stderr, "COLS %lld is not a multiple of the block size %lld\n",
                (long long) cols, (long long) ggml_blck_size(type));
        return 2;
    }
    if (threads > GGML_MAX_N_THREADS) {
        fprintf(stderr, "THREADS %d exceeds GGML_MAX_N_THREADS %d\n", threads, GGML_MAX_N_THREADS);
        return 2;
    }
    if (ring > GGML_DEFAULT_GRAPH_SIZE / 2) {
        fprintf(stderr, "RING %d exceeds %d nodes per graph\n", ring, GGML_DEFAULT_GRAPH_SIZE / 2);
        return 2;
    }

    ggml_cpu_init();
    printf("features avx2 %d avx512 %d avx512_vnni %d avx512_bf16 %d\n", ggml_cpu_has_avx2(),
           ggml_cpu_has_avx512(), ggml_cpu_has_avx512_vnni(), ggml_cpu_has_avx512_bf16());

    // Weight tensors without data: the bytes are ours (plain) or the repack buffer's.
    struct ggml_init_params weight_params = {
        .mem_size = (size_t) ring * ggml_tensor_overhead() + 1024,
        .mem_buffer = NULL,
        .no_alloc = true,
    };
    struct ggml_context * weight_ctx = ggml_init(weight_params);
    // Activations, outputs and the graph, allocated by the context.
    struct ggml_init_params compute_params = {
        .mem_size = ggml_graph_overhead() + (size_t) (ring + 1) * (ggml_tensor_overhead() + 64)
            + (size_t) cols * sizeof(float) + (size_t) ring * (size_t) rows * sizeof(float)
            + (1u << 20),
        .mem_buffer = NULL,
        .no_alloc = false,
    };
    struct ggml_context * ctx = ggml_init(compute_params);
    if (weight_ctx == NULL || ctx == NULL) {
        fprintf(stderr, "ggml_init failed\n");
        return 1;
    }
    struct ggml_tensor ** matrices = calloc((size_t) ring, sizeof(*matrices));
    for (int m = 0; m < ring; m++) {
        matrices[m] = ggml_new_tensor_2d(weight_ctx, type, cols, rows);
    }

    // All weights sit in huge pages, as our benches' weights do: with 4 KiB pages every row
    // stream restarts the prefetcher at page boundaries, which would handicap one side only.
    const size_t matrix_bytes = ggml_row_size(type, cols) * (size_t) rows;
    uint64_t rng = 42;
    uint8_t * weights = NULL;
    ggml_backend_buffer_t repacked = NULL;
    // The first matrix as generated, for the reference check of its first row.
    uint8_t * first_matrix = malloc(matrix_bytes);
    if (first_matrix == NULL) {
        fprintf(stderr, "cannot allocate %zu bytes\n", matrix_bytes);
        return 1;
    }
    if (repack) {
        ggml_backend_buffer_type_t buft = repack_buffer_type();
        if (buft == NULL) {
            fprintf(stderr, "this libggml-cpu has no CPU_REPACK buffer type\n");
            return 1;
        }
        repacked = ggml_backend_alloc_ctx_tensors_from_buft(weight_ctx, buft);
        if (repacked == NULL) {
            fprintf(stderr, "cannot allocate the CPU_REPACK buffer\n");
            return 1;
        }
        // init_tensor gave each tensor its repack traits; without them set_tensor would crash.
        if (matrices[0]->extra == NULL) {
            fprintf(stderr, "CPU_REPACK does not repack %s %lldx%lld on this CPU\n", argv[1],
                    (long long) rows, (long long) cols);
            return 1;
        }
        advise_huge(ggml_backend_buffer_get_base(repacked), ggml_backend_buffer_get_size(repacked));
        // Generated one matrix at a time into a scratch buffer and repacked from there.
        uint8_t * scratch = malloc(matrix_bytes);
        if (scratch == NULL) {
            fprintf(stderr, "cannot allocate %zu bytes\n", matrix_bytes);
            return 1;
        }
        for (int m = 0; m < ring; m++) {
            uint8_t * target = m == 0 ? first_matrix : scratch;
            if (type == GGML_TYPE_MXFP4) {
                fill_mxfp4(target, matrix_bytes, &rng);
            } else {
                fill_bf16(target, matrix_bytes, &rng);
            }
            ggml_backend_tensor_set(matrices[m], target, 0, matrix_bytes);
        }
        free(scratch);
    } else {
        const size_t stride = (matrix_bytes + 63) / 64 * 64;
        const size_t ring_bytes = (stride * (size_t) ring + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
        weights = aligned_alloc(HUGE_PAGE, ring_bytes);
        if (weights == NULL) {
            fprintf(stderr, "cannot allocate %zu bytes of weights\n", ring_bytes);
            return 1;
        }
        advise_huge(weights, ring_bytes);
        for (int m = 0; m < ring; m++) {
            uint8_t * target = weights + stride * (size_t) m;
            if (type == GGML_TYPE_MXFP4) {
                fill_mxfp4(target, matrix_bytes, &rng);
            } else {
                fill_bf16(target, matrix_bytes, &rng);
            }
            matrices[m]->data = target;
        }
        memcpy(first_matrix, weights, matrix_bytes);
    }

    struct ggml_tensor * x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, cols);
    float * x_data = (float *) x->data;
    for (int64_t c = 0; c < cols; c++) {
        x_data[c] = (float) (splitmix64(&rng) >> 40) / (float) (1u << 23) - 1.0f;
    }
    struct ggml_cgraph * graph = ggml_new_graph(ctx);
    struct ggml_tensor * first = NULL;
    for (int m = 0; m < ring; m++) {
        struct ggml_tensor * y = ggml_mul_mat(ctx, matrices[m], x);
        ggml_build_forward_expand(graph, y);
        if (m == 0) {
            first = y;
        }
    }

    // Pinned to cores 0..THREADS-1, one thread per core, as our benches' pool is.
    struct ggml_threadpool_params pool_params = ggml_threadpool_params_default(threads);
    for (int t = 0; t < threads; t++) {
        pool_params.cpumask[t] = true;
    }
    pool_params.strict_cpu = true;
    struct ggml_threadpool * pool = ggml_threadpool_new(&pool_params);
    if (pool == NULL) {
        fprintf(stderr, "ggml_threadpool_new failed\n");
        return 1;
    }
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    uint8_t * work = NULL;
    if (plan.work_size > 0) {
        work = malloc(plan.work_size);
        if (work == NULL) {
            fprintf(stderr, "cannot allocate a %zu-byte work buffer\n", plan.work_size);
            return 1;
        }
        plan.work_data = work;
    }

    // Warm-up: faults in the outputs and the work buffer, and starts the threads.
    if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "ggml_graph_compute failed\n");
        return 1;
    }
    long repeats = 0;
    const double start = now_seconds();
    double elapsed = 0.0;
    do {
        if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "ggml_graph_compute failed\n");
            return 1;
        }
        repeats++;
        elapsed = now_seconds() - start;
    } while (elapsed < min_seconds);

    const double bytes = (double) matrix_bytes * (double) ring * (double) repeats;
    printf("gbps %.4f\n", bytes / elapsed / 1e9);
    double checksum = 0.0;
    const float * y_data = (const float *) first->data;
    for (int64_t r = 0; r < rows; r++) {
        checksum += y_data[r];
    }
    printf("checksum %.6e\n", checksum);
    printf("row0_error %.3e\n", first_row_error(type, first_matrix, x_data, cols, y_data[0]));

    ggml_threadpool_free(pool);
    free(work);
    if (repacked != NULL) {
        ggml_backend_buffer_free(repacked);
    }
    free(weights);
    free(first_matrix);
    free(matrices);
    ggml_free(ctx);
    ggml_free(weight_ctx);
    return 0;
}
