/* A two-node transfer over TCP through the C ABI: a decode node listens on loopback, a prefill
 * node connects, one request's KV (two pools of one layer group, scattered slots on both sides)
 * moves chunk by chunk with the block source as a callback, then every destination byte is
 * compared with the source and every slot outside the registration must still be zero. Also
 * checks that a refused command returns KVPIPE_ERR_USAGE with the core's message.
 *
 * Built with -DLAYERS_PER_SLICE=N, each chunk goes out in layer ranges of N layers
 * (kvpipe_sender_submit_chunk_layers), each range its own slice, as an engine submits the
 * layers it has computed; a range out of order is refused.
 *
 * Built and run by scripts/test-c:  cc -std=c11 tcp_transfer.c -I../include libkvpipe_c.a ...  */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpipe.h"

#define LAYERS 4
#define POOLS 2
#define TPB 16
#define PROMPT 200
#define CHUNK 64
#define BLOCKS ((PROMPT + TPB - 1) / TPB)
#define SLOTS 64
/* kv_factor 2 × 2 heads × 16 tokens × 16 dims × 2 bytes = 2048 bytes per layer and block. */
#define LAYER_BLOCK_BYTES 2048
#define SLOT_BYTES (LAYER_BLOCK_BYTES * LAYERS / POOLS)
#define REQUEST 7

static int failures = 0;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "tcp_transfer.c:%d: ", __LINE__);                   \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, "\n");                                              \
            failures++;                                                         \
        }                                                                       \
    } while (0)

#define MUST(call)                                                              \
    do {                                                                        \
        kvpipe_status s_ = (call);                                              \
        if (s_ != KVPIPE_OK) {                                                  \
            fprintf(stderr, "tcp_transfer.c:%d: %s returned %s: %s\n", __LINE__, \
                    #call, kvpipe_status_name(s_), kvpipe_last_error_message()); \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

/* Where block ordinal o lives on each side. */
static uint32_t src_slot(uint32_t o) { return 3 + 2 * o; }
static uint32_t dst_slot(uint32_t o) { return 50 - 3 * o; }

/* The prefill engine's cache: every block of the request is resident up to `computed`. */
struct cache {
    uint32_t computed_blocks;
    int calls;
};

static int32_t block_source(void *user, uint64_t request, uint16_t group, uint32_t begin,
                            uint32_t end, kvpipe_block_run *out) {
    struct cache *c = user;
    c->calls++;
    if (request != REQUEST) return KVPIPE_BLOCK_SOURCE_UNKNOWN_REQUEST;
    if (group != 0) return KVPIPE_BLOCK_SOURCE_UNKNOWN_GROUP;
    if (end > c->computed_blocks) {
        out->allocated = c->computed_blocks;
        return KVPIPE_BLOCK_SOURCE_PAST_ALLOCATION;
    }
    out->first_ordinal = begin;
    out->len = end - begin;
    for (uint32_t o = begin; o < end; o++) out->ids[o - begin] = src_slot(o);
    return KVPIPE_BLOCK_SOURCE_OK;
}

static int32_t unknown_status_source(void *user, uint64_t request, uint16_t group, uint32_t begin,
                                     uint32_t end, kvpipe_block_run *out) {
    (void)user, (void)request, (void)group, (void)begin, (void)end, (void)out;
    return 42;
}

static uint8_t pattern(int pool, size_t offset) {
    return (uint8_t)((offset * 131u + (size_t)pool * 17u + (offset >> 11)) % 251u + 1u);
}

static void config_for(kvpipe_node_config *cfg, kvpipe_layer_group *group, kvpipe_pool *pools,
                       kvpipe_region *regions, uint8_t *mem[POOLS], uint32_t first_region) {
    for (int p = 0; p < POOLS; p++) {
        pools[p] = (kvpipe_pool){.region = first_region + (uint32_t)p,
                                 .layer_begin = (uint16_t)(p * LAYERS / POOLS),
                                 .layers = LAYERS / POOLS,
                                 .slot_bytes = SLOT_BYTES};
        regions[p] = (kvpipe_region){.id = first_region + (uint32_t)p, .ptr = mem[p],
                                     .len = (size_t)SLOTS * SLOT_BYTES};
    }
    *group = (kvpipe_layer_group){.layers = LAYERS, .kv_factor = 2, .kv_heads = 2,
                                  .head_dim = 16, .elem_bytes = 2, .tokens_per_block = TPB,
                                  .window = 0, .pools = pools, .pool_count = POOLS};
    *cfg = (kvpipe_node_config){.groups = group, .group_count = 1, .regions = regions,
                                .region_count = POOLS};
}

/* Polls a node until an event of `kind` for `request` (or any peer event when request is 0). */
static kvpipe_event wait_sender(kvpipe_sender *tx, kvpipe_event_kind kind) {
    kvpipe_event ev;
    for (int i = 0; i < 200; i++) {
        kvpipe_status s = kvpipe_sender_poll_event(tx, 50, &ev);
        if (s == KVPIPE_NO_EVENT) continue;
        MUST(s);
        if (ev.kind == kind) return ev;
        CHECK(ev.kind != KVPIPE_EVENT_FAILED && ev.kind != KVPIPE_EVENT_TIMED_OUT,
              "prefill side: unexpected event: %s", ev.message);
    }
    fprintf(stderr, "prefill side: no event of kind %d within 10 s\n", (int)kind);
    exit(1);
}

static kvpipe_event wait_receiver(kvpipe_receiver *rx, kvpipe_event_kind kind) {
    kvpipe_event ev;
    for (int i = 0; i < 200; i++) {
        kvpipe_status s = kvpipe_receiver_poll_event(rx, 50, &ev);
        if (s == KVPIPE_NO_EVENT) continue;
        MUST(s);
        if (ev.kind == kind) return ev;
        CHECK(ev.kind != KVPIPE_EVENT_FAILED && ev.kind != KVPIPE_EVENT_TIMED_OUT,
              "decode side: unexpected event: %s", ev.message);
    }
    fprintf(stderr, "decode side: no event of kind %d within 10 s\n", (int)kind);
    exit(1);
}

int main(void) {
    size_t pool_bytes = (size_t)SLOTS * SLOT_BYTES;
    uint8_t *src[POOLS], *dst[POOLS];
    for (int p = 0; p < POOLS; p++) {
        src[p] = malloc(pool_bytes);
        dst[p] = calloc(1, pool_bytes);
        if (!src[p] || !dst[p]) return 1;
        for (size_t i = 0; i < pool_bytes; i++) src[p][i] = pattern(p, i);
    }

    kvpipe_layer_group sgroup, rgroup;
    kvpipe_pool spools[POOLS], rpools[POOLS];
    kvpipe_region sregions[POOLS], rregions[POOLS];
    kvpipe_node_config scfg, rcfg;
    config_for(&scfg, &sgroup, spools, sregions, src, 1);
    config_for(&rcfg, &rgroup, rpools, rregions, dst, 100);
    /* The core's default deadlines, with a shorter wait for the other side's results. */
    kvpipe_deadlines deadlines;
    kvpipe_deadlines_default(&deadlines);
    CHECK(deadlines.handshake_ms == 5000 && deadlines.result_per_token_us == 2000,
          "default deadlines: handshake %llu ms", (unsigned long long)deadlines.handshake_ms);
    deadlines.result_wait_ms = 20000;
    rcfg.deadlines = &deadlines;
    scfg.deadlines = &deadlines;

    kvpipe_receiver *rx = NULL;
    kvpipe_sender *tx = NULL;
    /* A layout whose second pool has no memory is refused at once. */
    kvpipe_node_config partial = scfg;
    partial.region_count = 1;
    kvpipe_status made = kvpipe_tcp_sender_new(&partial, &tx);
    CHECK(made == KVPIPE_ERR_INVALID_ARGUMENT && tx == NULL, "a missing region: %s",
          kvpipe_status_name(made));
    CHECK(strstr(kvpipe_last_error_message(), "no memory was given for region#2") != NULL,
          "message: \"%s\"", kvpipe_last_error_message());
    MUST(kvpipe_tcp_receiver_new(&rcfg, &rx));
    MUST(kvpipe_tcp_sender_new(&scfg, &tx));
    uint16_t port = 0;
    MUST(kvpipe_receiver_listen(rx, "127.0.0.1:0", &port));
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    uint32_t receiver_peer = 0;
    MUST(kvpipe_sender_connect(tx, addr, &receiver_peer));
    kvpipe_event ready = wait_receiver(rx, KVPIPE_EVENT_PEER_READY);
    CHECK(ready.peer_role == 1, "the decode side sees a prefill peer (role %u)", ready.peer_role);
    uint32_t sender_peer = ready.peer;
    wait_sender(tx, KVPIPE_EVENT_PEER_READY);

    /* The decode side registers every block of the prompt before prefill starts. */
    uint32_t dst_ids[BLOCKS];
    for (uint32_t o = 0; o < BLOCKS; o++) dst_ids[o] = dst_slot(o);
    kvpipe_block_list list = {.first_ordinal = 0, .ids = dst_ids, .count = BLOCKS};
    kvpipe_registration reg = {.request = REQUEST, .prompt_len = PROMPT, .groups = &list,
                               .group_count = 1, .writers = &sender_peer, .writer_count = 1,
                               .aux_capacity = 1024};
    uint32_t rslice = KVPIPE_NO_SLICE;
    MUST(kvpipe_receiver_register(rx, &reg, &rslice));
    CHECK(rslice != KVPIPE_NO_SLICE, "the registration has an id");

    /* A command the core refuses: a chunk for a request never opened. */
    struct cache cache = {.computed_blocks = 0, .calls = 0};
    kvpipe_chunk first = {.start = 0, .end = CHUNK, .prompt_len = PROMPT};
    kvpipe_status s = kvpipe_sender_submit_chunk(tx, 99, &first, block_source, &cache, NULL);
    CHECK(s == KVPIPE_ERR_USAGE, "chunk of an unknown request: %s", kvpipe_status_name(s));
    CHECK(strstr(kvpipe_last_error_message(), "req#99 is not known") != NULL,
          "the core's message: \"%s\"", kvpipe_last_error_message());
    s = kvpipe_sender_submit_chunk(tx, REQUEST, NULL, block_source, &cache, NULL);
    CHECK(s == KVPIPE_ERR_INVALID_ARGUMENT, "a null chunk: %s", kvpipe_status_name(s));

    MUST(kvpipe_sender_open(tx, REQUEST, &receiver_peer, 1));
    s = kvpipe_sender_submit_chunk(tx, REQUEST, &first, unknown_status_source, NULL, NULL);
    CHECK(s == KVPIPE_ERR_INVALID_ARGUMENT, "an unknown callback status: %s",
          kvpipe_status_name(s));
    CHECK(strstr(kvpipe_last_error_message(), "returned 42") != NULL, "message: \"%s\"",
          kvpipe_last_error_message());

    /* Prefill, chunk by chunk: each chunk's blocks go out as soon as it is submitted. */
    int sent_slices = 0;
#ifdef LAYERS_PER_SLICE
    uint32_t layer_count = 0;
    MUST(kvpipe_sender_layer_count(tx, &layer_count));
    CHECK(layer_count == LAYERS, "the rank's layers: %u", layer_count);
    int ranges = (LAYERS + LAYERS_PER_SLICE - 1) / LAYERS_PER_SLICE;
    int first_calls = cache.calls;
#endif
    for (uint32_t start = 0; start < PROMPT; start += CHUNK) {
        uint32_t end = start + CHUNK < PROMPT ? start + CHUNK : PROMPT;
        int last = end == PROMPT;
        cache.computed_blocks = last ? BLOCKS : end / TPB;
        kvpipe_chunk chunk = {.start = start, .end = end, .prompt_len = PROMPT,
                              .prepopulated_len = 0, .is_last = last};
        uint32_t slice = KVPIPE_NO_SLICE;
#ifdef LAYERS_PER_SLICE
        /* Each range of layers as soon as the engine computed it; the first one names the
         * chunk's blocks. Starting past layer 0 is refused, and changes nothing. */
        s = kvpipe_sender_submit_chunk_layers(tx, REQUEST, &chunk, 1, 2, block_source, &cache,
                                              &slice);
        CHECK(s == KVPIPE_ERR_USAGE && strstr(kvpipe_last_error_message(), "layer 0") != NULL,
              "a range past layer 0 first: %s: %s", kvpipe_status_name(s),
              kvpipe_last_error_message());
        for (uint32_t layer = 0; layer < LAYERS; layer += LAYERS_PER_SLICE) {
            uint32_t layer_end = layer + LAYERS_PER_SLICE < LAYERS ? layer + LAYERS_PER_SLICE
                                                                   : LAYERS;
            slice = KVPIPE_NO_SLICE;
            MUST(kvpipe_sender_submit_chunk_layers(tx, REQUEST, &chunk, layer, layer_end,
                                                   block_source, &cache, &slice));
            if (slice != KVPIPE_NO_SLICE) sent_slices++;
        }
#else
        MUST(kvpipe_sender_submit_chunk(tx, REQUEST, &chunk, block_source, &cache, &slice));
        if (slice != KVPIPE_NO_SLICE) sent_slices++;
#endif
    }
#ifdef LAYERS_PER_SLICE
    CHECK(sent_slices == 4 * ranges, "4 chunks in %d layer ranges each (got %d slices)", ranges,
          sent_slices);
    CHECK(cache.calls - first_calls == 4, "one block query per chunk, by its first range (got %d)",
          cache.calls - first_calls);
#else
    CHECK(sent_slices == 4, "4 chunks sent blocks (got %d)", sent_slices);
#endif
    uint32_t first_tokens[2] = {1234, 5678};
    kvpipe_aux aux = {.prompt_tokens = PROMPT, .cached_tokens = 0, .first_tokens = first_tokens,
                      .first_token_count = 2};
    MUST(kvpipe_sender_submit_aux(tx, REQUEST, &aux));

    kvpipe_event done = wait_receiver(rx, KVPIPE_EVENT_COMPLETED);
    uint64_t expected = (uint64_t)BLOCKS * SLOT_BYTES * POOLS;
    CHECK(done.request == REQUEST, "completed request %llu", (unsigned long long)done.request);
    CHECK(done.bytes_written == expected, "decode side: %llu bytes written, expected %llu",
          (unsigned long long)done.bytes_written, (unsigned long long)expected);
    CHECK(done.has_aux && done.first_token_count == 2 && done.first_tokens[0] == 1234 &&
              done.first_tokens[1] == 5678,
          "the aux data arrived");
    wait_receiver(rx, KVPIPE_EVENT_QUIESCED);
    kvpipe_event sent = wait_sender(tx, KVPIPE_EVENT_COMPLETED);
    CHECK(sent.bytes_written == expected, "prefill side: %llu bytes written",
          (unsigned long long)sent.bytes_written);
    wait_sender(tx, KVPIPE_EVENT_QUIESCED);
    MUST(kvpipe_sender_retire(tx, REQUEST));
    MUST(kvpipe_receiver_retire(rx, REQUEST));
    s = kvpipe_sender_open(tx, REQUEST, &receiver_peer, 1);
    CHECK(s == KVPIPE_ERR_USAGE && strstr(kvpipe_last_error_message(), "retired") != NULL,
          "a retired request is refused: %s", kvpipe_last_error_message());

    kvpipe_counters rc;
    MUST(kvpipe_receiver_counters(rx, &rc));
    CHECK(rc.bytes_landed == expected && rc.writes_refused == 0,
          "landed %llu bytes, refused %llu writes", (unsigned long long)rc.bytes_landed,
          (unsigned long long)rc.writes_refused);

    /* Every byte: each registered destination slot equals its source slot; others are zero. */
    uint64_t checked = 0;
    for (int p = 0; p < POOLS; p++) {
        for (uint32_t slot = 0; slot < SLOTS; slot++) {
            const uint8_t *d = dst[p] + (size_t)slot * SLOT_BYTES;
            int ordinal = -1;
            for (uint32_t o = 0; o < BLOCKS; o++)
                if (dst_slot(o) == slot) ordinal = (int)o;
            for (size_t i = 0; i < SLOT_BYTES; i++) {
                uint8_t want =
                    ordinal < 0 ? 0 : src[p][(size_t)src_slot((uint32_t)ordinal) * SLOT_BYTES + i];
                if (d[i] != want) {
                    CHECK(0, "pool %d slot %u byte %zu: %u, expected %u", p, slot, i, d[i], want);
                    break;
                }
                checked++;
            }
        }
    }
    CHECK(checked == (uint64_t)POOLS * pool_bytes, "checked %llu bytes",
          (unsigned long long)checked);

    MUST(kvpipe_sender_close(tx, 5000));
    MUST(kvpipe_receiver_close(rx, 5000));
    s = kvpipe_sender_cancel(tx, REQUEST);
    CHECK(s == KVPIPE_ERR_CLOSED, "a closed node: %s", kvpipe_status_name(s));
    kvpipe_sender_free(tx);
    kvpipe_receiver_free(rx);
    for (int p = 0; p < POOLS; p++) free(src[p]), free(dst[p]);

    if (failures) {
        fprintf(stderr, "tcp_transfer: %d check(s) failed\n", failures);
        return 1;
    }
    printf("tcp_transfer: OK: %llu bytes moved over TCP, %llu destination bytes checked\n",
           (unsigned long long)expected, (unsigned long long)checked);
    return 0;
}
