// Dump llama.cpp's logits for a prompt and its greedy continuation (for
// bench/record_llamacpp_logits.py, which builds and runs this; not part of localllm).
//
//   llamacpp_logits MODEL.gguf N_PREDICT PROMPT
//
// The prompt is tokenized by llama.cpp (add_special = true). F32 KV cache and no flash
// attention, so llama.cpp computes in plain float32. Prints to stdout:
//   ids <prompt ids...>
//   row <i> <n_vocab logits...>      one line per prompt position
//   greedy <ids...>                  argmax continuation, N_PREDICT steps (EOG not special)
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int argmax(const float * x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[best]) best = i;
    return best;
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N_PREDICT PROMPT\n", argv[0]);
        return 2;
    }
    const int n_predict = atoi(argv[2]);
    const std::string prompt = argv[3];
    llama_log_set(quiet, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    std::vector<llama_token> ids(prompt.size() + 8);
    int n = llama_tokenize(vocab, prompt.c_str(), (int) prompt.size(), ids.data(),
                           (int) ids.size(), true, false);
    if (n < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
    ids.resize(n);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + n_predict + 8;
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = cp.n_ctx;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create context\n"); return 1; }

    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch)) { fprintf(stderr, "decode failed\n"); return 1; }

    printf("ids");
    for (int i = 0; i < n; i++) printf(" %d", ids[i]);
    printf("\n");
    for (int i = 0; i < n; i++) {
        const float * row = llama_get_logits_ith(ctx, i);
        printf("row %d", i);
        for (int v = 0; v < n_vocab; v++) printf(" %.9g", row[v]);
        printf("\n");
    }
    std::vector<llama_token> out;
    llama_token tok = argmax(llama_get_logits_ith(ctx, n - 1), n_vocab);
    for (int s = 0; s < n_predict; s++) {
        out.push_back(tok);
        if (s + 1 == n_predict) break;
        llama_batch one = llama_batch_get_one(&tok, 1);
        if (llama_decode(ctx, one)) { fprintf(stderr, "decode failed\n"); return 1; }
        tok = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
    }
    printf("greedy");
    for (llama_token t : out) printf(" %d", t);
    printf("\n");
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
