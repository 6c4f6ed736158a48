// llama.cpp's EAGLE-3 head over a fixed token sequence, for the EAGLE-3 parity fixtures
// (tools/parity/make_eagle3_fixtures.sh), run as llama.cpp's draft-eagle3 speculator runs it
// (common/speculative.cpp): the target decodes the ids in one batch with the head's layers
// extracted; the head's encoder turns each token's three states into g; the decoder reads the
// pairs (id[P + 1], g[P]) at positions P = 0 .. N - 2; then it drafts DRAFT tokens, each its
// argmax fed back at the next position with the last row's pre-norm state as g.
//
//   eagle3_logits TARGET HEAD TOP DRAFT ID...
//
// Prints one JSON array per decoder row (N - 1 rows, then DRAFT): the TOP best
// [target id, log-probability] pairs, the log-softmax taken in double precision over the
// tokens the head can name.
#include "llama.h"
#include "../../src/llama-ext.h"
#include "rows.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s TARGET HEAD TOP DRAFT ID...\n", argv[0]);
        return 1;
    }
    const int top = atoi(argv[3]), n_draft = atoi(argv[4]);
    std::vector<llama_token> ids;
    for (int i = 5; i < argc; i++) ids.push_back(atoi(argv[i]));
    const int n = (int) ids.size();
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = false;
    llama_model * tgt = llama_model_load_from_file(argv[1], mp);
    llama_model * dft = llama_model_load_from_file(argv[2], mp);
    if (!tgt || !dft) return 1;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * ctx_tgt = llama_init_from_model(tgt, cp);
    cp.ctx_other = ctx_tgt;
    cp.n_rs_seq = 0;
    llama_context * ctx_dft = llama_init_from_model(dft, cp);
    if (!ctx_tgt || !ctx_dft) return 1;

    const int32_t * layers = llama_model_target_layer_ids(dft);
    const int n_layers = (int) llama_model_target_layer_ids_n(dft);
    const int n_layer_tgt = llama_model_n_layer(tgt);
    const int d_tgt = llama_model_n_embd(tgt), d = llama_model_n_embd(dft);
    for (int k = 0; k < n_layers; k++) {
        if (layers[k] < n_layer_tgt) {
            llama_set_embeddings_layer_inp(ctx_tgt, (uint32_t) layers[k], true);
        } else {
            llama_set_embeddings_nextn(ctx_tgt, true, false);
        }
    }
    llama_set_embeddings_nextn(ctx_dft, true, true);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(tgt));

    // The target over every id.
    llama_batch_ext * b = llama_batch_ext_init(ctx_tgt);
    for (int i = 0; i < n; i++) {
        int idx = llama_batch_ext_add_token(b, 0, ids[i]);
        llama_pos pos = i;
        llama_batch_ext_set_pos(b, idx, &pos);
        llama_batch_ext_set_output_logits(b, idx, true);
    }
    if (llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, b) != 0) return 1;
    llama_batch_ext_free(b);

    // The encoder: g per token.
    std::vector<float> feat((size_t) n * n_layers * d_tgt);
    for (int k = 0; k < n_layers; k++) {
        const float * l = layers[k] < n_layer_tgt ? llama_get_embeddings_layer_inp(ctx_tgt, layers[k])
                                                  : llama_get_embeddings_nextn(ctx_tgt);
        if (!l) return 1;
        for (int i = 0; i < n; i++) {
            memcpy(&feat[((size_t) i * n_layers + k) * d_tgt], l + (size_t) i * d_tgt, d_tgt * sizeof(float));
        }
    }
    llama_batch_ext * e = llama_batch_ext_init(ctx_dft);
    for (int i = 0; i < n; i++) {
        int idx = llama_batch_ext_add_embd(e, 0, {&feat[(size_t) i * n_layers * d_tgt], 1, (size_t) n_layers * d_tgt});
        llama_pos pos = i;
        llama_batch_ext_set_pos(e, idx, &pos);
        llama_batch_ext_set_output_logits(e, idx, true);
    }
    if (llama_process(ctx_dft, LLAMA_PROCESS_TYPE_ENCODE, e) != 0) return 1;
    std::vector<float> g((size_t) n * d);
    memcpy(g.data(), llama_get_embeddings_nextn(ctx_dft), g.size() * sizeof(float));

    // The decoder over the pairs, then the drafts.
    llama_batch_ext * t = llama_batch_ext_init(ctx_dft);
    for (int p = 0; p + 1 < n; p++) {
        int idx = llama_batch_ext_add_token(t, 0, ids[p + 1]);
        llama_pos pos = p;
        llama_batch_ext_set_pos(t, idx, &pos);
        llama_batch_ext_set_embd_token(t, idx, {&g[(size_t) p * d], 1, (size_t) d});
        llama_batch_ext_set_output_logits(t, idx, true);
    }
    if (llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, t) != 0) return 1;
    int last = 0;
    for (int p = 0; p + 1 < n; p++) last = print_row(llama_get_logits_ith(ctx_dft, p), n_vocab, top);
    std::vector<float> h(llama_get_embeddings_nextn_ith(ctx_dft, n - 2), llama_get_embeddings_nextn_ith(ctx_dft, n - 2) + d);
    for (int k = 0; k < n_draft; k++) {
        llama_batch_ext_clear(t);
        int idx = llama_batch_ext_add_token(t, 0, last);
        llama_pos pos = n - 1 + k;
        llama_batch_ext_set_pos(t, idx, &pos);
        llama_batch_ext_set_embd_token(t, idx, {h.data(), 1, (size_t) d});
        llama_batch_ext_set_output_logits(t, idx, true);
        if (llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, t) != 0) return 1;
        last = print_row(llama_get_logits_ith(ctx_dft, 0), n_vocab, top);
        const float * hn = llama_get_embeddings_nextn_ith(ctx_dft, 0);
        h.assign(hn, hn + d);
    }
    llama_batch_ext_free(t);
    llama_batch_ext_free(e);
    llama_free(ctx_dft);
    llama_free(ctx_tgt);
    llama_model_free(dft);
    llama_model_free(tgt);
    return 0;
}
