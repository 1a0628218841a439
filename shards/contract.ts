/**
 * What a compiled shard directory promises to the engine: the manifest's shape and the names,
 * dtypes and shapes of every stage graph's inputs and outputs. The shard compiler writes to this
 * contract and the engine reads from it; neither looks at the other's code.
 *
 * Stage graph I/O (B = batch, S = new positions, P = past length, T = P + S, kvH = KV heads,
 * hd = head dim, D = hidden size, V = vocab, K = logits kept):
 *   inputs
 *     input_ids                     int64 [B, S]          stage that holds the embedding
 *     hidden_states                 f32   [B, S, D]       every other stage
 *     position_ids                  int64 [B, S]
 *     attention_mask                int64 [B, T]          1 = attend, 0 = padding
 *     past_key_values.{l}.key       f32   [B, kvH, P, hd] for each global layer l of the stage (P may be 0)
 *     past_key_values.{l}.value     f32   [B, kvH, P, hd]
 *     num_logits_to_keep            int64 []              last stage only: logits for the last K positions (0 = all)
 *   outputs
 *     present.{l}.key / .value      f32   [B, kvH, T, hd]
 *     logits                        f32   [B, K, V]       last stage
 *     hidden_states_out             f32   [B, S, D]       every other stage
 * Key j is visible to query i (at index P + i) iff j <= P + i and attention_mask[b, j] = 1; rotary
 * positions come from position_ids alone, so left padding in a batch is just mask zeros.
 *
 * 'ort-contrib' graphs (batchPadding 'right', compiler ≥ 6) attend over each row's own length
 * L_b = sum(attention_mask[b]) instead: a row's past is its first L_b − S columns, wherever P ends,
 * so a past may be a buffer wider than the live context and T = max_b L_b. Columns past a row's
 * live ones must be finite (a one-position step reads the whole buffer and masks them to exact
 * zeros; they change no bit of the result). Such graphs have no present outputs; instead
 *     new_key_values.{l}.key / .value f32 [B, kvH, S, hd] row b's S new positions (they belong at its columns L_b − S .. L_b − 1)
    new_key_values                f32   [B, 2·n·kvH, S, hd] (compiler ≥ 8) the same, every layer's key then value in
                                                          layer order along axis 1 (n = the stage's layers): one output
                                                          to fetch instead of 2n (each fetched output costs ~6 µs)
 *   greedy_token                  int64 [B, K, 1]       (compiler ≥ 10, last stage, 'ort-contrib') each kept position's
 *                                                         largest logit's index (TopK k = 1: the lowest index of a tie, NaN
 *                                                         never): fetched instead of the logits when every row is greedy
 * so an engine keeps its cache in a buffer of its own and writes the new columns into it (the
 * runtime would copy a whole present out every step). Steps of several positions attend with
 * onnxruntime's GroupQueryAttention (the same bits however a prompt is chunked); one-position steps
 * over a non-empty past read the buffer in place (bit-identical for a row whatever the batch and
 * the buffer's width, not to GroupQueryAttention's one-position bits).
 *
 * Static graphs (`shoal shard --static CTX[,CHUNK]`, for NPUs, which compile only fixed shapes;
 * StageManifest.static names them): every dimension is a number, batch 1, S = CHUNK (prefill) or
 * 1 (decode), over a KV buffer of CTX slots that the graph writes in place by slot:
 *   inputs
 *     input_ids / hidden_states     as above with B = 1, S fixed (rows past the real ones: padding)
 *     position_ids                  int64 [1, S]          rotary positions
 *     cache_position                int64 [S]             the KV slot each new position is written to
 *     attention_mask                int64 [1, CTX]        1 = slot holds a real position
 *     past_key_values.{l}.key/value f32   [1, kvH, CTX, hd] the whole buffer (slots ≥ live length: anything finite)
 *   outputs
 *     present.{l}.key / .value      f32   [1, kvH, CTX, hd] the buffer with the new positions written
 *     logits                        f32   [1, S, V]       last stage: every position's (no num_logits_to_keep)
 *     hidden_states_out             f32   [1, S, D]       every other stage
 * Key slot j is visible to new position i iff j <= cache_position[i] and attention_mask[0, j] = 1.
 * Padding rows of a chunk get slots after the real ones (cache_position + i < CTX), so no real
 * position sees them, and the next step overwrites them.
 */

export const MANIFEST_FORMAT = 'shoal-shards/1'
export const MANIFEST_FILE = 'manifest.json'
export const STAGE_GRAPH_FILE = 'model.onnx'
/** A stage's weights: one external data file, read by its graphs. */
export const STAGE_DATA_FILE = `${STAGE_GRAPH_FILE}.data`
/** A stage's one-position graph (StageManifest.decodeGraph), beside STAGE_GRAPH_FILE and reading its weights file. */
export const STAGE_DECODE_GRAPH_FILE = 'decode.onnx'

export const INPUT_IDS = 'input_ids'
export const HIDDEN_IN = 'hidden_states'
export const HIDDEN_OUT = 'hidden_states_out'
export const POSITION_IDS = 'position_ids'
export const ATTENTION_MASK = 'attention_mask'
export const LOGITS = 'logits'
export const NUM_LOGITS_TO_KEEP = 'num_logits_to_keep'
/** Static graphs only: the KV slot of each new position. */
export const CACHE_POSITION = 'cache_position'
export const pastKeyName = (layer: number): string => `past_key_values.${layer}.key`
export const pastValueName = (layer: number): string => `past_key_values.${layer}.value`
export const presentKeyName = (layer: number): string => `present.${layer}.key`
export const presentValueName = (layer: number): string => `present.${layer}.value`
/** 'ort-contrib' graphs (compiler ≥ 6): the step's new positions' KV alone, in place of present (see the I/O table above). */
export const newKeyName = (layer: number): string => `new_key_values.${layer}.key`
export const newValueName = (layer: number): string => `new_key_values.${layer}.value`
/** Compiler ≥ 8: every layer's new key and value columns in one output (see the I/O table above). */
export const NEW_KV = 'new_key_values'
/** Compiler ≥ 10, last stage of 'ort-contrib' graphs: each kept position's greedy token (see the I/O table above). */
export const GREEDY_TOKEN = 'greedy_token'

export type Quantization =
  | { kind: 'none' }
  /**
   * `activations`: what the MatMulNBits nodes compute in. 'int8' (faster; the engine batches only
   * equally long contexts, unpadded) or 'f32' (batched with any mix of lengths). Absent (compilers
   * before version 3): int8.
   */
  | {
    kind: 'int8' | 'int4'
    blockSize: 32 | 128
    activations?: 'int8' | 'f32'
    /**
     * How the token embedding is stored. 'int4' (int4 shards, compiler 5+ default): the same 4-bit
     * blocks and scales as the MatMulNBits weights, looked up by com.microsoft GatherBlockQuantized
     * (compilers 5–10) or by a Gather of the bytes unpacked in standard ops (11+); either way a row
     * reads exactly its dequantized value. 'f32' or absent (int8 shards, older compilers,
     * `embedding: 'f32'`, or a hidden size that is not a multiple of the block size): f32 Gather.
     */
    embedding?: 'int4' | 'f32'
    /**
     * int4, block 32, int8 activations only: 'native' writes every product as a MatMulQ4 node
     * (NATIVE_KERNEL_DOMAIN) in place of MatMulNBits, for the benchmarks and tests that compare the
     * two — never chosen by shoal, whose nodes make the same swap when they load a graph and have
     * the kernel (daemon/engine/native), so that the shards stay the same everywhere. Only a
     * process with daemon/engine/native/ort-kernels.c loaded can run it. Absent: MatMulNBits.
     */
    kernel?: 'native'
  }

/** The architecture-independent shape of a model, after normalising its HF config. */
export interface ModelShape {
  architecture: string
  hiddenSize: number
  numLayers: number
  numHeads: number
  numKvHeads: number
  headDim: number
  intermediateSize: number
  vocabSize: number
  /** Context limit in tokens (max_position_embeddings). */
  maxPositions: number
  rmsNormEps: number
  tieWordEmbeddings: boolean
  /** Mixture-of-experts layers; absent for dense models. */
  moe?: MoeShape
}

/**
 * A mixture-of-experts model's routing: in each layer of `moeLayers` the MLP is replaced by a
 * router (softmax over `numExperts` logits, top `topK`), the selected experts' SwiGLU MLPs
 * (width `expertIntermediateSize`) and their probability-weighted sum; every other layer keeps a
 * dense MLP of width `intermediateSize`.
 */
export interface MoeShape {
  numExperts: number
  topK: number
  expertIntermediateSize: number
  /** Renormalise the top-k probabilities to sum to 1 (Mixtral, Qwen3-MoE) or use them as they are (Qwen2-MoE). */
  normTopK: boolean
  /** Width of a shared expert every row runs, scaled by sigmoid(shared_expert_gate · x) (Qwen2-MoE); 0 = none. */
  sharedExpertIntermediateSize: number
  /** Global indices of the MoE layers, ascending. */
  moeLayers: number[]
}

export interface ShardFile {
  /** Relative to the shard directory, '/'-separated. */
  path: string
  sha256: string
  bytes: number
}

export interface StageManifest {
  index: number
  /** Inclusive global layer range [first, last]. */
  layers: [number, number]
  hasEmbedding: boolean
  hasHead: boolean
  /** Directory of this stage, relative to the shard directory. */
  dir: string
  /** The stage's ONNX graph, relative to the shard directory. */
  graph: string
  /**
   * The stage graph with its one-position Ifs inline (shards/graph/decode-graph.ts; compiler ≥ 13,
   * 'ort-contrib' only), relative to the shard directory: for steps of one position over a
   * non-empty past buffer, where it gives the stage graph's bits without its Ifs' cost. It reads
   * the stage graph's weights file.
   */
  decodeGraph?: string
  /** Every file of the stage (static graphs and their weights included). */
  files: ShardFile[]
  /** Fixed-shape graphs (ShardManifest.static), relative to the shard directory; absent without --static. */
  static?: StaticStageGraphs
}

export interface StaticStageGraphs {
  /** [1, chunk] positions per run. */
  prefill: string
  /** [1, 1] positions per run. */
  decode: string
}

/** The fixed shapes of every stage's static graphs (`shoal shard --static CTX[,CHUNK]`). */
export interface StaticShapes {
  /** KV buffer slots (CTX): the most positions a sequence can hold on the static graphs. */
  contextLength: number
  /** Positions per prefill run (CHUNK). */
  chunk: number
  /** The op table of the static graphs: always 'standard' (NPU compilers read no contrib ops). */
  opSet: 'standard'
}

export interface GenerationDefaults {
  bosTokenId?: number
  /** Generation stops at any of these. */
  eosTokenIds: number[]
  /** Whether a text prompt gets BOS prepended (from tokenizer_config's add_bos_token or the tokenizer's post-processor). */
  addBosToken: boolean
  /**
   * Whether tokenizer.json's post-processor already inserts BOS when encoding with special tokens
   * (so an engine that wants BOS and encodes with add_special_tokens must not add it again).
   */
  tokenizerAddsBos?: boolean
}

/**
 * How an 'ort-contrib' graph's one-position steps attend over the past buffer
 * (shards/graph/attention.ts `decodeAttentionNodes`): 'per-head' (one query head a product, on
 * MLAS's one-row kernels that read the past in place) or 'grouped' (a kv head's query heads as
 * the rows of one product, the past packed first). The same tokens either way, to float
 * rounding; which is faster depends on the CPU (daemon/engine/kernel-probe.ts times both).
 * 'native': one DecodeAttention node a layer, a kernel onnxruntime does not have — only a process
 * with daemon/engine/native/ort-kernels.c loaded can run it. The compiler writes it only when
 * asked (tests, benchmarks); a node with shoal's kernels makes that graph of either other form
 * in memory when it loads it (daemon/engine/native/swap.ts), so the shards stay the same.
 */
export type DecodeAttentionForm = 'per-head' | 'grouped' | 'native'
export const DECODE_ATTENTION_FORMS: readonly DecodeAttentionForm[] = ['per-head', 'grouped', 'native']
/**
 * The op domain of shoal's own kernels (daemon/engine/native/ort-kernels.c): MatMulQ4, which
 * nodes swap in for MatMulNBits at load, and the 'native' form's DecodeAttention.
 */
export const NATIVE_KERNEL_DOMAIN = 'ai.shoal'

export interface ShardManifest {
  format: typeof MANIFEST_FORMAT
  /** Model id served over the API (defaults to the checkpoint directory's name). */
  modelId: string
  /** sha256 over the checkpoint's files, so a cache can be keyed by it. */
  sourceHash: string
  shape: ModelShape
  quantization: Quantization
  /** Which op table built the graphs ('standard' is portable ONNX; 'ort-contrib' uses com.microsoft ops). */
  opSet: string
  generation: GenerationDefaults
  /** Tokenizer files copied into the shard directory (relative paths). */
  tokenizerFiles: ShardFile[]
  stages: StageManifest[]
  /** Free-form provenance, e.g. "random weights (demo)". */
  description?: string
  /** Version of the shard compiler that wrote the directory (caches key on it). */
  compilerVersion?: number
  /**
   * 'left': rows of a batch may be left-padded (attention_mask zeros before each row's tokens,
   * past caches aligned at the right) and every real position's logits equal the row run alone
   * up to float rounding. 'right': rows may be right-padded (each row's tokens first, then
   * attention_mask zeros; past caches aligned at the left) and the graph attends over each row's
   * own length, so every row equals the row run alone bit for bit, whatever the mix of lengths.
   * 'none' or absent (older compilers): run rows one at a time.
   */
  batchPadding?: 'left' | 'right' | 'none'
  /**
   * false: a step with batch > 1, more than one new position and a non-empty past (a batched
   * chunked-prefill continuation) is refused by the runtime; run such rows one at a time (a
   * batched first prefill, past empty, and batched decode, S = 1, are fine). Absent or true:
   * every step shape works. 'ort-contrib' graphs say false: onnxruntime's GroupQueryAttention
   * takes S > 1 after a past only at batch 1.
   */
  batchedPrefillWithPast?: boolean
  /** 'ort-contrib' graphs (compiler ≥ 12): the one-position attention's form. Absent: 'per-head'. */
  decodeAttention?: DecodeAttentionForm
  /** Present when the stages also carry fixed-shape graphs (StageManifest.static). */
  static?: StaticShapes
}
