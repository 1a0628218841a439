/**
 * Prompt lookup on by default: where a model served without `--draft` gets it, and which of its
 * requests run speculatively. Pure decisions over model facts and a request's sampling, so the
 * daemon (per model) and the speculation wrapper (per request) agree and tests need no model.
 *
 * Lookup costs nothing to run (no model, microseconds per proposal) and adaptive K drops to 0 where
 * nothing repeats (reproduction/results/speculative.md: 0.98–1.03× plain), so it may be on by
 * default wherever it keeps what the request was promised:
 *  - the target must verify exactly enough: a verify step of K + 1 positions differs from
 *    one-position decoding only in the last f32 bits (as padded batches already do) with f32
 *    activations, but by whole quantization steps with int8 activations (inexactTarget), so
 *    the compiler's default int4/int8 shards are skipped, quietly;
 *  - where requests enter: a whole model, or a chain coordinated here (its stage 0), whose chains
 *    keep their KV prefix reuse under it (daemon/pipeline's service); a later stage has no
 *    requests of its own, and a local multi-device chain (`shoal serve` of a split shard) none yet.
 *    On a whole model only while the request has the engine to itself (speculation.ts `wrap`);
 *    on a chain beside other requests too (`wrapChain`: a round saves a traversal of every hop);
 *  - greedy requests (the target's own tokens) and sampled requests without a seed (the target's
 *    distribution exactly; no draw was promised) run speculatively;
 *  - seeded sampled requests keep the plain path. Speculative sampling makes different draws than
 *    plain sampling (one per examined draft, then one for the correction), and how many depends
 *    on K, which adaptive K picks from measured step times: the same seed would give different
 *    tokens from run to run with the machine's load (the explicit `--draft` path pins K for seeded
 *    requests for that reason, but its tokens still differ from the plain path's). A seed promises
 *    the same tokens on every run and on every replica — and a replica with int8-activation
 *    shards, or `--draft none`, decodes plainly — so only the plain path keeps it.
 */
import type { ShardManifest } from '../../shards/index.ts'
import type { SamplingParams } from '../service.ts'
import { exactVerifyNeeds, inexactTarget } from './exact.ts'

/** What the default needs to know of a served model. */
export interface ModelFacts {
  /** Requests enter here: a whole model (one engine) or a chain's stage 0 coordinating the chain; not a later stage. */
  entry: boolean
  quantization: ShardManifest['quantization']
  /** shoal's kernels its graphs run here (capabilities' names; inexactTarget). */
  kernels?: readonly string[]
}

/** The drafter name a default prompt lookup reports (metrics, receipts, /v1/mesh). */
export const DEFAULT_LOOKUP_NAME = 'prompt-lookup (default)'

/**
 * The shortest n-gram the default lookup drafts from. A one-token match (the last token occurred
 * before) is what text that does not repeat offers all the time and almost never predicts; every
 * such round is a verify step that, among batched streams, runs outside the batch and delays the
 * others. Text that does repeat matches two tokens a step later. (`--draft lookup` keeps 1.)
 */
export const DEFAULT_LOOKUP_MIN_NGRAM = 2

/**
 * Where a verified position is dear, the default drafts only from three-token matches: a whole
 * model whose verify is exact only on shoal's kernels (int8 activations: each position's attention
 * computed as a one-position step computes it, its products in int8 row by row), where a round of
 * K + 1 ≤ 5 positions costs 2–3 steps. Two-token matches there come mostly from stray repeats
 * whose rounds fail: on the paired benchmark's random prompts (results/speculative.md, wave 48) a
 * three-token minimum decoded 1.04–1.10× what two gave (60m and 250m int4, two runs), and the copy
 * task kept its speed-up. With f32 activations a verify's positions ride on one pass over the
 * weights, and two-token matches pay (250m fp32: 0.96× with three); on a chain a round saves a
 * traversal of every hop, so two stay there too.
 */
export function defaultLookupMinNgram (model: Pick<ShardManifest, 'quantization'>, onChain: boolean): number {
  return !onChain && exactVerifyNeeds(model) !== undefined ? 3 : DEFAULT_LOOKUP_MIN_NGRAM
}

/** Why a model served without `--draft` gets no prompt lookup, or undefined when it gets it. */
export function defaultLookupSkipped (model: ModelFacts): string | undefined {
  if (!model.entry) return 'a later stage of a chain (requests enter at stage 0)'
  const why = inexactTarget(model, model.kernels)
  return why === undefined ? undefined : 'int8 activations (a verify step could round to a different token than plain decoding)'
}

/** Whether a request to a model with default prompt lookup runs speculatively (see above). */
export function defaultLookupTakes (sampling: Pick<SamplingParams, 'temperature' | 'seed'>): boolean {
  return sampling.temperature <= 0 || sampling.seed === undefined
}

/** The whole choice: does this request to this model, served without `--draft`, use prompt lookup. */
export function useDefaultLookup (model: ModelFacts, sampling: Pick<SamplingParams, 'temperature' | 'seed'>): boolean {
  return defaultLookupSkipped(model) === undefined && defaultLookupTakes(sampling)
}
