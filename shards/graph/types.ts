/**
 * The graph builder's shared types: what every block gets (BuildContext), the op table's shape
 * (OpTable) and the attention primitive's tables and I/O. Kept apart from the code so blocks,
 * attention and the op tables depend on these types, not on each other.
 */
import type { ModelSpec, MoeWeights } from '../architectures.ts'
import type { DecodeAttentionForm, Quantization } from '../contract.ts'
import type { F32Tensor } from '../safetensors.ts'
import type { GraphBuilder } from './builder.ts'

export interface BuildContext {
  g: GraphBuilder
  spec: ModelSpec
  ops: OpTable
  quant: Quantization
  /** MatMulNBits accuracy_level (0: f32 activations; 4: int8 activations, faster). */
  accuracyLevel: number
  /**
   * 'ort-contrib' stage graphs for an engine that keeps its KV in place: one-position steps attend
   * over the past buffer in place (no present), every step outputs only its new columns.
   */
  decodeInPlace?: boolean
  /** With decodeInPlace: the one-position attention's form (default 'per-head'). */
  decodeAttention?: DecodeAttentionForm
}

export interface OpTable {
  name: 'standard' | 'ort-contrib'
  /** Whether a step with batch > 1, S > 1 and a non-empty past runs (written to the manifest when not). */
  batchedPrefillWithPast: boolean
  /** How rows of a batch are padded (written to the manifest; see ShardManifest.batchPadding). */
  batchPadding: 'left' | 'right'
  /** y = x / sqrt(mean(x², last axis) + eps) · weight */
  rmsNorm: (g: GraphBuilder, name: string, x: string, weight: string, eps: number) => string
  /**
   * sum = x + update; normed = rmsNorm(sum). Used only inside a layer (attention residual →
   * post-attention norm), never across layers, so a stage cut never separates the two.
   */
  addNorm: (g: GraphBuilder, name: string, addName: string, x: string, update: string, weight: string, eps: number) => { sum: string, normed: string }
  /** Per-stage tensors the attention primitive needs (built once, shared by the stage's layers). */
  stageTables: (ctx: BuildContext, positionIds: string, attentionMask: string, sequenceSource: string) => StageTables
  /** Rotary, KV update and masked attention: q/k/v [B, S, ·] → context [B, S, H·hd], present K/V. */
  attention: (ctx: BuildContext, name: string, weightPrefix: string, io: AttentionIo, tables: StageTables) => AttentionOut
  /**
   * Routed experts: rows x [N, D] and router logits [N, E] → for each row, the sum over its top-k
   * experts (softmax probabilities, renormalised when shape.moe.normTopK) of weight · expert(row),
   * [N, D]. Ties in the top-k go to the lower expert index.
   */
  experts: (ctx: BuildContext, name: string, weightPrefix: string, x: string, routerLogits: string, w: MoeWeights) => string
}

export type StageTables =
  | {
    kind: 'standard'
    cos: string
    sin: string
    /** bool [B, 1, 1, S, T]: key visible to query. */
    allowed: string
  }
  | {
    /** Fixed-shape graphs (graph/static.ts): a KV buffer of CTX slots written in place. */
    kind: 'static'
    cos: string
    sin: string
    /** bool [1, 1, 1, S, CTX]: key slot visible to query. */
    allowed: string
    /** int64 [1, kvH, S, hd]: each new position's slot, broadcast for ScatterElements. */
    slots: string
  }
  | {
    kind: 'gqa'
    positionIds: string
    cosCache: string
    sinCache: string
    /** int32 [B]: each row's own length − 1 (rows are right-padded; attention_mask sums to the length). */
    seqlensK: string
    /** int32 [1]: T. */
    totalLength: string
    /** One-position steps' tables over the past buffer, made with the first layer that needs them (decodeInPlace). */
    decode?: DecodeTables
    /**
     * int64 [B, kvH, S, 1]: the columns of GroupQueryAttention's present that hold each row's new
     * positions (L_b − S .. L_b − 1), for GatherND with batch_dims 2 (the new_key_values outputs;
     * it copies whole head_dim rows, ~40 % cheaper a step than GatherElements element by element).
     * Builds its nodes, named under `prefix`, where it is called: a several-position branch.
     */
    newColumns: (prefix: string) => string
  }

export interface AttentionIo {
  /** The fused projection [B, S, (H + 2·kvH)·hd], for primitives that take it packed. */
  qkv: string
  /** Its q/k/v parts, split on first use (an unused Split would still run). */
  split: () => { q: string, k: string, v: string }
  qNorm?: F32Tensor
  kNorm?: F32Tensor
  pastK: string
  pastV: string
}

export interface AttentionOut {
  context: string
  /** The layer's present KV; with `BuildContext.decodeInPlace`, only the step's new columns [B, kvH, S, hd]. */
  presentK: string
  presentV: string
}

/**
 * What a stage's one-position attentions share (shards/graph/attention.ts decodeTables): the
 * condition, the additive mask over the past buffer, a column of ones for the sums, and each
 * row's live past columns (int32 [B]; optional for callers that build the nodes alone, which the
 * 'native' form needs).
 */
export interface DecodeTables { cond: string, bias: string, ones: string, seqlensK?: string }
