// Dump llama.cpp's pooled embeddings of texts (for bench/record_llamacpp_embeddings.py,
// which builds and runs this; not part of localllm).
//
//   llamacpp_embed MODEL.gguf TEXT...
//
// Each text is tokenized by llama.cpp (add_special = true: [CLS] ... [SEP] for a BERT vocab,
// parse_special = false) and evaluated alone, in one batch, with embeddings on and the
// model's own pooling (pooling_type unspecified: the GGUF's {arch}.pooling_type), one thread.
// Prints per text:
//   ids <token ids...>
//   embd <n_embd floats>        llama_get_embeddings_seq: pooled, NOT normalised
#include "llama.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf TEXT...\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_embd = llama_model_n_embd(model);

    for (int a = 2; a < argc; a++) {
        const std::string text = argv[a];
        std::vector<llama_token> ids(text.size() + 8);
        int n = llama_tokenize(vocab, text.c_str(), (int) text.size(), ids.data(),
                               (int) ids.size(), true, false);
        if (n < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
        ids.resize(n);

        // a fresh context per text: nothing of one input can reach the next
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = n + 8;
        cp.n_batch = cp.n_ctx;
        cp.n_ubatch = cp.n_ctx;
        cp.n_threads = 1;
        cp.n_threads_batch = 1;
        cp.embeddings = true;
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
        const float * e = llama_get_embeddings_seq(ctx, 0);
        if (!e) { fprintf(stderr, "no pooled embedding (pooling type none?)\n"); return 1; }

        printf("ids");
        for (int i = 0; i < n; i++) printf(" %d", ids[i]);
        printf("\nembd");
        for (int i = 0; i < n_embd; i++) printf(" %.9g", e[i]);
        printf("\n");
        llama_batch_free(batch);
        llama_free(ctx);
    }
    llama_model_free(model);
    return 0;
}
