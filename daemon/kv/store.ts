/**
 * What KV mobility needs from whatever holds a node's kept prefixes (the engine's local service
 * implements it): who the KV belongs to, a copy of the longest kept prefix of some tokens, and a
 * way to keep KV that came from elsewhere exactly as if it had been computed here.
 */

/** Whose KV this is: the fields of a prefix scope, and the tensor shape of one position. */
export interface KvStoreInfo {
  /** The served model id (a puller names the model it wants by it). */
  modelId: string
  /** What scopes the KV: the manifest's sha256 (or a local stand-in when none was given). */
  manifestHash: string
  /** Inclusive global layer range of the stage that holds the KV. */
  layers: readonly [number, number]
  dtype: 'float32'
  numKvHeads: number
  headDim: number
}

/** A copy of a kept prefix's KV. */
export interface ExportedPrefix {
  /** Positions it holds: the first `tokens` of the tokens asked about. */
  tokens: number
  /** Per stage layer, in order, its key then its value: each [numKvHeads, tokens, headDim] float32. */
  layers: Float32Array[]
}

export interface KvStore {
  info (): KvStoreInfo
  /** The longest kept prefix of `tokens` (undefined: none kept). */
  exportPrefix (tokens: readonly number[], signal: AbortSignal): Promise<ExportedPrefix | undefined>
  /**
   * Keeps `layers` (laid out as ExportedPrefix.layers) as the KV of `tokens`; the next request
   * whose prompt starts with them reuses it. `kept` false: the budget had no room (or it adds
   * nothing), and the KV was dropped.
   */
  importPrefix (tokens: readonly number[], layers: Float32Array[], signal: AbortSignal): Promise<{ kept: boolean, bytes: number }>
  /**
   * A chain stage's prefixes are kept under its coordinators' keys, not by token ids (a stage sees
   * activations): a copy of at most `maxLength` positions of what this store keeps under `key` for
   * coordinator `owner` (undefined: not kept, or not for that owner). Absent: keys are not served.
   */
  exportKept? (key: string, owner: string, maxLength: number, signal: AbortSignal): Promise<ExportedPrefix | undefined>
  /** Keeps `layers` as the prefix of `tokens.length` positions under `key` for coordinator `owner` (as a finish with keep would). */
  importKept? (key: string, owner: string, tokens: readonly number[], layers: Float32Array[], signal: AbortSignal): Promise<{ kept: boolean, bytes: number }>
}

/** KV bytes per position of a stage: key and value, every layer, float32. */
export function kvBytesPerToken (info: Pick<KvStoreInfo, 'layers' | 'numKvHeads' | 'headDim'>): number {
  return 2 * (info.layers[1] - info.layers[0] + 1) * info.numKvHeads * info.headDim * 4
}

/** How a pull of a peer's prefix ended. Any failure means the prompt is prefilled here instead. */
export type PullOutcome =
  | { ok: true, tokens: number, bytes: number, ms: number }
  | { ok: false, reason: string, code: string }

/** Pulls the longest prefix of `tokens` that `peerId` holds into this node's store. */
export type PullPrefix = (args: { peerId: string, tokens: readonly number[], signal: AbortSignal }) => Promise<PullOutcome>
