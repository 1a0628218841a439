/**
 * KV prefix reuse: what a node keeps of finished sequences' KV caches and how a new request finds
 * the longest prefix it can start from — chained token-block hashes scoped by model, layer range
 * and dtype; an LRU index with a byte budget that never evicts a leased entry; the reuse decision.
 * The engine holds the tensors (StageRunner `retain` / `openFrom`); the local service wires the
 * two together.
 *
 * KV mobility: moving a kept prefix to another node (/shoal/kv/1.0.0) — the wire format and the
 * puller's checks (wire.ts), the pull decision (decide.ts shouldPull), the holder and the puller
 * over libp2p (transport.ts), the store interface the local service and chain stages implement
 * (store.ts), and one pull's plan and bounded run for both (pull-plan.ts).
 */
export { blockHashes, compactHash, exactPrefixHashes, prefixScope, DEFAULT_BLOCK_SIZE, SUMMARY_HASH_HEX } from './hash.ts'
export type { PrefixScopeInit } from './hash.ts'
export { decideReuse, defaultKvCacheBytes, DEFAULT_MIN_PREFILL_TOKENS, DEFAULT_PULL_MARGIN, MIN_PULL_WAIT_MS, pullCost, pullWaitMs, shouldPull } from './decide.ts'
export type { PullCostInput, ReuseInput } from './decide.ts'
export { DEFAULT_LINK_RTT_MS, DEFAULT_PREFILL_TOKENS_PER_SECOND, planPull, runPull } from './pull-plan.ts'
export type { PullPlan, PullPlanInput, RunPullInit } from './pull-plan.ts'
export { createLinkRates, MAX_LINK_PEERS, PROBE_LINK_BYTES_PER_SECOND } from './link-rates.ts'
export type { LinkEstimate, LinkRates } from './link-rates.ts'
export { kvBytesPerToken } from './store.ts'
export type { ExportedPrefix, KvStore, KvStoreInfo, PullOutcome, PullPrefix } from './store.ts'
export { createPrefixCache } from './cache.ts'
export type { InsertResult, PrefixCache, PrefixCacheInit, PrefixCacheStats, PrefixLease, PrefixMatch } from './cache.ts'
export { createPrefixMetrics } from './metrics.ts'
export type { PrefixMetrics } from './metrics.ts'
export { cachedTokensFor, mergeSummaries, summaryHashes } from './summary.ts'
export {
  createFrameSplitter, createPrefixReceiver, decodePayload, encodeFrame, encodeFrameParts, encodePayloadParts, transferFrames,
  DEFAULT_MAX_CHUNK_BYTES, HASH_BYTES, KV_PROTOCOL, KV_WIRE_VERSION, MAX_CHUNK_BYTES, MAX_FRAME_BYTES,
} from './wire.ts'
export type { KvFrame, KvFrameKind, KvScopeFields, PrefixExpectation, PrefixReceiver, PrefixTransfer, ReceivedPrefix } from './wire.ts'
export { KvRefusedError, KvWireError } from './errors.ts'
export type { KvRefusalCode, KvWireErrorCode } from './errors.ts'
export { createKvPuller, serveKv, DEFAULT_PULL_TIMEOUT_MS } from './transport.ts'
export type { KvPuller, KvPullerComponents, KvPullerInit, KvTransportComponents, PullRequest, ServeKvInit } from './transport.ts'
