// Teacher-forced log-probabilities from llama.cpp's CPU build, for the architecture parity
// fixtures (tools/parity/make_arch_fixtures.sh).
//
//   llama_logits MODEL N_PROMPT TOP ID...
//
// The first N_PROMPT ids run as one batch (every position's logits kept), the rest one per
// step, each fed the given id. Prints one JSON array per position: the TOP best
// [id, log-probability] pairs, the log-softmax taken in double precision.
#include "llama.h"
#include "rows.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL N_PROMPT TOP ID...\n", argv[0]);
        return 1;
    }
    int n_prompt = atoi(argv[2]), top = atoi(argv[3]);
    std::vector<llama_token> ids;
    for (int i = 4; i < argc; i++) ids.push_back(atoi(argv[i]));
    if (n_prompt < 1 || n_prompt > (int) ids.size()) {
        fprintf(stderr, "N_PROMPT out of range\n");
        return 1;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    // Plain CPU buffers: the AMX repacking may be unusable in a VM (and is another rounding).
    mp.use_extra_bufts = false;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.swa_full = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    // quiver synth files have no tokenizer: `vocab_size` dummy tokens.
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_batch b = llama_batch_init(n_prompt, 0, 1);
    for (int i = 0; i < n_prompt; i++) {
        b.token[i] = ids[i];
        b.pos[i] = i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = 1;
    }
    b.n_tokens = n_prompt;
    if (llama_decode(ctx, b) != 0) return 1;
    for (int i = 0; i < n_prompt; i++) print_row(llama_get_logits_ith(ctx, i), n_vocab, top);
    for (int i = n_prompt; i < (int) ids.size(); i++) {
        llama_batch one = llama_batch_get_one(&ids[i], 1);
        if (llama_decode(ctx, one) != 0) return 1;
        print_row(llama_get_logits_ith(ctx, -1), n_vocab, top);
    }
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
