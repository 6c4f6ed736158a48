// Dumps every contiguous f32 tensor llama.cpp computes for a prompt and some decode steps, so
// that quiver (QUIVER_DUMP_DIR) can be compared with it op by op (tools/parity/compare.py).
//
//   llama_dump MODEL OUT_DIR N_PROMPT N_DECODE ID...
//
// The first N_PROMPT ids are the prompt, the next N_DECODE are fed one per step. With
// TAIL=k the prompt runs as two steps, its last k tokens apart, as llama-server runs the
// prompt of a model with sliding-window layers (k = 4). Writes OUT_DIR/s{step}_{n}.bin and
// OUT_DIR/index.txt (step, n, name, ne0..ne3).
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static int g_step = 0, g_n = 0;
static FILE * g_index = nullptr;
static std::string g_dir;

static bool on_tensor(struct ggml_tensor * t, bool ask, void *) {
    if (ask) {
        return true;
    }
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
        return true;
    }
    std::vector<float> v(ggml_nelements(t));
    ggml_backend_tensor_get(t, v.data(), 0, ggml_nbytes(t));
    std::string path = g_dir + "/s" + std::to_string(g_step) + "_" + std::to_string(g_n) + ".bin";
    FILE * f = fopen(path.c_str(), "wb");
    fwrite(v.data(), sizeof(float), v.size(), f);
    fclose(f);
    fprintf(g_index, "%d %d %s %lld %lld %lld %lld\n", g_step, g_n, t->name, (long long) t->ne[0],
            (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3]);
    g_n++;
    return true;
}

static bool run(llama_context * ctx, std::vector<llama_token> & ids, int from, int n) {
    llama_batch b = llama_batch_get_one(ids.data() + from, n);
    bool ok = llama_decode(ctx, b) == 0;
    g_step++;
    g_n = 0;
    return ok;
}

int main(int argc, char ** argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s MODEL OUT_DIR N_PROMPT N_DECODE ID...\n", argv[0]);
        return 1;
    }
    g_dir = argv[2];
    int n_prompt = atoi(argv[3]), n_decode = atoi(argv[4]);
    std::vector<llama_token> ids;
    for (int i = 5; i < argc; i++) {
        ids.push_back(atoi(argv[i]));
    }
    g_index = fopen((g_dir + "/index.txt").c_str(), "w");
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = false;  // plain CPU buffers (AMX repacking may be unusable in a VM)
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    llama_context_params cp = llama_context_default_params();
    // As the reference llama-server ran: -c 4096 -t 2, default batch sizes, SWA cache not full.
    cp.n_ctx = 4096;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.swa_full = false;
    cp.cb_eval = on_tensor;
    llama_context * ctx = llama_init_from_model(model, cp);
    int tail = getenv("TAIL") ? atoi(getenv("TAIL")) : 0;
    bool ok = true;
    if (tail > 0 && tail < n_prompt) {
        ok = run(ctx, ids, 0, n_prompt - tail) && run(ctx, ids, n_prompt - tail, tail);
    } else {
        ok = run(ctx, ids, 0, n_prompt);
    }
    for (int k = 0; ok && k < n_decode; k++) {
        ok = run(ctx, ids, n_prompt + k, 1);
    }
    fclose(g_index);
    if (!ok) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    return 0;
}
