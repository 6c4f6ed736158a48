// llama.cpp's multi-token-prediction block over a fixed token sequence, for the MTP parity
// fixtures (tools/parity/make_mtp_fixtures.sh), run as llama.cpp's draft-mtp speculator runs
// it (common/speculative.cpp): the target decodes the ids in one batch with its nextn hidden
// states kept; an MTP context of the same model (LLAMA_CONTEXT_TYPE_MTP) reads each token at
// its own position P paired with the target's state at P - 1 (zeros at P = 0); then it drafts
// DRAFT tokens, each its argmax fed back at the next position with the block's own normed
// state.
//
//   mtp_logits MODEL TOP DRAFT ID...
//
// Prints one JSON array per block row (N rows, then DRAFT): the TOP best
// [token id, log-probability] pairs, the log-softmax taken in double precision.
#include "llama.h"
#include "../../src/llama-ext.h"
#include "rows.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL TOP DRAFT ID...\n", argv[0]);
        return 1;
    }
    const int top = atoi(argv[2]), n_draft = atoi(argv[3]);
    std::vector<llama_token> ids;
    for (int i = 4; i < argc; i++) ids.push_back(atoi(argv[i]));
    const int n = (int) ids.size();
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = false;
    mp.load_mtp = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model || llama_model_n_layer_nextn(model) < 1) return 1;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * ctx_tgt = llama_init_from_model(model, cp);
    cp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    cp.ctx_other = ctx_tgt;
    cp.n_rs_seq = 0;
    llama_context * ctx_dft = llama_init_from_model(model, cp);
    if (!ctx_tgt || !ctx_dft) return 1;
    llama_set_embeddings_nextn(ctx_tgt, true, false);
    llama_set_embeddings_nextn(ctx_dft, true, true);
    // (The state the block reads: n_embd wide, DeepSeek-V4's hc streams side by side.)
    const int d = llama_model_n_embd_out(model);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    // The target over every id, its nextn states kept.
    llama_batch_ext * b = llama_batch_ext_init(ctx_tgt);
    for (int i = 0; i < n; i++) {
        int idx = llama_batch_ext_add_token(b, 0, ids[i]);
        llama_pos pos = i;
        llama_batch_ext_set_pos(b, idx, &pos);
        llama_batch_ext_set_output_logits(b, idx, true);
    }
    if (llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, b) != 0) return 1;
    llama_batch_ext_free(b);
    std::vector<float> h((size_t) n * d);
    memcpy(h.data(), llama_get_embeddings_nextn(ctx_tgt), h.size() * sizeof(float));

    // The block over (id[P], h[P - 1]) at P, zeros at 0; then the drafts.
    std::vector<float> zeros(d, 0.0f);
    llama_batch_ext * t = llama_batch_ext_init(ctx_dft);
    for (int p = 0; p < n; p++) {
        int idx = llama_batch_ext_add_token(t, 0, ids[p]);
        llama_pos pos = p;
        llama_batch_ext_set_pos(t, idx, &pos);
        const float * row = p == 0 ? zeros.data() : &h[(size_t) (p - 1) * d];
        llama_batch_ext_set_embd_token(t, idx, {row, 1, (size_t) d});
        llama_batch_ext_set_output_logits(t, idx, true);
    }
    if (llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, t) != 0) return 1;
    int last = 0;
    for (int p = 0; p < n; p++) last = print_row(llama_get_logits_ith(ctx_dft, p), n_vocab, top);
    const float * hn = llama_get_embeddings_nextn_ith(ctx_dft, n - 1);
    std::vector<float> g(hn, hn + d);
    for (int k = 0; k < n_draft; k++) {
        llama_batch_ext_clear(t);
        int idx = llama_batch_ext_add_token(t, 0, last);
        llama_pos pos = n + k;
        llama_batch_ext_set_pos(t, idx, &pos);
        llama_batch_ext_set_embd_token(t, idx, {g.data(), 1, (size_t) d});
        llama_batch_ext_set_output_logits(t, idx, true);
        if (llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, t) != 0) return 1;
        last = print_row(llama_get_logits_ith(ctx_dft, 0), n_vocab, top);
        hn = llama_get_embeddings_nextn_ith(ctx_dft, 0);
        g.assign(hn, hn + d);
    }
    llama_batch_ext_free(t);
    llama_free(ctx_dft);
    llama_free(ctx_tgt);
    llama_model_free(model);
    return 0;
}
