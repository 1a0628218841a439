/**
 * Chain formation for pipeline-sharded models: a pure function that picks one holder per stage so
 * the stages cover every layer exactly once, all built from the same manifest (same hash), at the
 * lowest cost by load and RTT. It is a shortest path over layer boundaries 0..numLayers where a
 * holder of layers [a, b] is an edge a → b + 1; for each manifest hash the cheapest path wins.
 * When no complete chain exists it says which layers nobody holds (or where ranges fail to meet).
 */
import type { LoadSnapshot } from './decision.ts'

/** Inclusive layer range [first, last]. */
export type LayerRange = readonly [number, number]

export interface StageHolder {
  peerId: string
  modelId: string
  /** Hash of the shard manifest the holder loaded; stages from different manifests never mix. */
  manifestHash: string
  layers: LayerRange
  /** Mesh admission and reachability, as for whole-model candidates. */
  admitted: boolean
  alive: boolean
  load?: LoadSnapshot
  rttMs?: number
  /**
   * The holder's measured decode step time for its layers (ms, gossiped in its capabilities):
   * what one token costs there, whatever the device. A holder that has not measured yet is
   * charged the median per-layer time of those that have (among the same manifest's holders)
   * times its layer count, so a new holder is neither shunned nor preferred.
   */
  stepMs?: number
  /** Lossy activation encodings the holder decodes (its capabilities; absent: f32 only). */
  activations?: readonly string[]
  /** shoal's kernels its stage runs (its capabilities' names; absent: onnxruntime's only). */
  kernels?: readonly string[]
}

export interface ChainPolicy {
  /** Load older than this is ignored (scored as unknown). */
  staleAfterMs: number
  maxQueueDepth: number
  /** Added per stage so that, all else equal, fewer hops win. */
  hopCostMs: number
  /** Per queued or in-flight sequence on a stage. */
  perSequenceCostMs: number
  /** Charged for a stage whose load is unknown or stale. */
  unknownLoadCostMs: number
}

export const DEFAULT_CHAIN_POLICY: Readonly<ChainPolicy> = Object.freeze({
  staleAfterMs: 5_000,
  maxQueueDepth: 64,
  hopCostMs: 5,
  perSequenceCostMs: 20,
  unknownLoadCostMs: 50,
})

export interface ChainContext {
  now: number
  modelId: string
  numLayers: number
  /** Only this manifest, when the caller already knows which one it wants. */
  manifestHash?: string
  exclude?: readonly string[]
  policy?: Partial<ChainPolicy>
  /**
   * A chain worth keeping when it is still whole: the one whose stages hold this prompt's prefix
   * in their KV caches. It is chosen while its cost is within `slackMs` (the prefill it saves) of
   * the cheapest chain's, so it is kept exactly while what it saves outweighs how much slower it
   * is now (as preferPrefixHolder does for replicas).
   */
  prefer?: { stages: ReadonlyArray<{ peerId: string, layers: LayerRange }>, slackMs: number }
  /**
   * Only holders that run all of these of shoal's kernels: a request speculating on an
   * int8-activation model verifies exactly only where every stage computes a verify as it
   * decodes (daemon/speculative/exact.ts).
   */
  kernels?: readonly string[]
}

export interface ChainStage {
  peerId: string
  layers: LayerRange
  costMs: number
}

export type ChainDecision =
  | { kind: 'chain', manifestHash: string, stages: ChainStage[], costMs: number }
  /** Holders exist but every complete chain needs an overloaded stage. */
  | { kind: 'overloaded', manifestHash: string, reason: string }
  /**
   * No complete chain. `missing`: layers no usable holder covers (for the manifest that came
   * closest); when empty, ranges overlap without meeting at a boundary: `stuckAt` is the first
   * layer that no path reaches.
   */
  | { kind: 'incomplete', manifestHash: string | undefined, missing: LayerRange[], stuckAt: number | undefined, reason: string }

const measured = (h: StageHolder): boolean => h.stepMs !== undefined && Number.isFinite(h.stepMs) && h.stepMs >= 0

/** `msPerLayer`: what a holder that has not measured its step time is charged per layer (see StageHolder.stepMs). */
function stageCost (h: StageHolder, ctx: ChainContext, p: ChainPolicy, msPerLayer = 0): number {
  const rtt = Math.max(h.rttMs ?? 0, 0)
  const step = measured(h) ? h.stepMs! : msPerLayer * (h.layers[1] - h.layers[0] + 1)
  const load = h.load
  if (load === undefined || ctx.now - load.observedAt > p.staleAfterMs) return p.hopCostMs + rtt + step + p.unknownLoadCostMs
  return p.hopCostMs + rtt + step + (load.expectedQueueWaitMs ?? 0) + (load.queueDepth + load.inFlight) * p.perSequenceCostMs
}

/** Median measured step time per layer among holders (0 when none has measured). */
function typicalStepPerLayer (holders: readonly StageHolder[]): number {
  const known = holders.filter(measured).map(h => h.stepMs! / (h.layers[1] - h.layers[0] + 1)).sort((a, b) => a - b)
  if (known.length === 0) return 0
  const mid = Math.floor(known.length / 2)
  return known.length % 2 === 1 ? known[mid]! : (known[mid - 1]! + known[mid]!) / 2
}

function isOverloaded (h: StageHolder, ctx: ChainContext, p: ChainPolicy): boolean {
  const load = h.load
  if (load === undefined || ctx.now - load.observedAt > p.staleAfterMs) return false
  return load.accepting === false || load.queueDepth >= p.maxQueueDepth
}

function validRange (r: LayerRange, numLayers: number): boolean {
  return Number.isInteger(r[0]) && Number.isInteger(r[1]) && r[0] >= 0 && r[0] <= r[1] && r[1] < numLayers
}

/** Layers in [0, numLayers) that no range covers, as maximal inclusive ranges. */
export function uncovered (ranges: readonly LayerRange[], numLayers: number): LayerRange[] {
  const covered = new Uint8Array(numLayers)
  for (const [a, b] of ranges) covered.fill(1, a, b + 1)
  const out: LayerRange[] = []
  for (let l = 0; l < numLayers; l++) {
    if (covered[l] === 1) continue
    const start = l
    while (l + 1 < numLayers && covered[l + 1] === 0) l++
    out.push([start, l])
  }
  return out
}

interface Path { cost: number, stages: ChainStage[] }

/** Cheapest exact cover of [0, numLayers) by the given holders, or the first unreachable boundary. */
function shortestChain (holders: readonly StageHolder[], ctx: ChainContext, p: ChainPolicy): Path | { stuckAt: number } {
  const L = ctx.numLayers
  const best: Array<Path | undefined> = new Array(L + 1).fill(undefined)
  best[0] = { cost: 0, stages: [] }
  const byStart = new Map<number, StageHolder[]>()
  for (const h of holders) byStart.set(h.layers[0], [...(byStart.get(h.layers[0]) ?? []), h])
  const typical = typicalStepPerLayer(holders)
  // Edges only go forward, so boundaries in increasing order are a topological order.
  for (let a = 0; a < L; a++) {
    const from = best[a]
    if (from === undefined) continue
    for (const h of byStart.get(a) ?? []) {
      const to = h.layers[1] + 1
      const cost = stageCost(h, ctx, p, typical)
      const total = from.cost + cost
      const cur = best[to]
      // Ties: fewer stages, then the smaller peer id, so the result does not depend on input order.
      if (cur === undefined || total < cur.cost ||
        (total === cur.cost && (from.stages.length + 1 < cur.stages.length ||
          (from.stages.length + 1 === cur.stages.length && h.peerId < (cur.stages.at(-1)?.peerId ?? ''))))) {
        best[to] = { cost: total, stages: [...from.stages, { peerId: h.peerId, layers: h.layers, costMs: cost }] }
      }
    }
  }
  const done = best[L]
  if (done !== undefined) return done
  let reached = 0
  for (let b = 0; b <= L; b++) if (best[b] !== undefined) reached = b
  return { stuckAt: reached }
}

/**
 * The preferred chain priced as it stands, when every stage of it is still a usable holder of the
 * same manifest and its ranges still cover every layer in order; undefined otherwise.
 */
function preferredPath (holders: readonly StageHolder[], stages: ReadonlyArray<{ peerId: string, layers: LayerRange }>, ctx: ChainContext, p: ChainPolicy): Path | undefined {
  const typical = typicalStepPerLayer(holders)
  let next = 0
  let cost = 0
  const out: ChainStage[] = []
  for (const want of stages) {
    const h = holders.find(x => x.peerId === want.peerId && x.layers[0] === want.layers[0] && x.layers[1] === want.layers[1])
    if (h === undefined || h.layers[0] !== next || isOverloaded(h, ctx, p)) return undefined
    const c = stageCost(h, ctx, p, typical)
    cost += c
    out.push({ peerId: h.peerId, layers: h.layers, costMs: c })
    next = h.layers[1] + 1
  }
  return next === ctx.numLayers && out.length > 0 ? { cost, stages: out } : undefined
}

/** Whether a holder says it runs every one of `kernels` (shoal's kernels, by their capability names). */
export function runsKernels (holder: Pick<StageHolder, 'kernels'>, kernels: readonly string[]): boolean {
  return kernels.every(k => holder.kernels?.includes(k) === true)
}

/** Forms the cheapest complete chain for `ctx.modelId`, or says why there is none. */
export function formChain (holders: readonly StageHolder[], ctx: ChainContext): ChainDecision {
  const p: ChainPolicy = { ...DEFAULT_CHAIN_POLICY, ...ctx.policy }
  const exclude = new Set(ctx.exclude ?? [])
  const groups = new Map<string, StageHolder[]>()
  for (const h of holders) {
    if (h.modelId !== ctx.modelId || !h.admitted || !h.alive || exclude.has(h.peerId)) continue
    if (ctx.manifestHash !== undefined && h.manifestHash !== ctx.manifestHash) continue
    if (ctx.kernels !== undefined && !runsKernels(h, ctx.kernels)) continue
    if (!validRange(h.layers, ctx.numLayers)) continue
    groups.set(h.manifestHash, [...(groups.get(h.manifestHash) ?? []), h])
  }
  if (groups.size === 0) {
    return { kind: 'incomplete', manifestHash: ctx.manifestHash, missing: [[0, ctx.numLayers - 1]], stuckAt: 0, reason: `no reachable, admitted node holds a stage of ${ctx.modelId}` }
  }
  let chosen: { hash: string, path: Path } | undefined
  let overloadedHash: string | undefined
  let closest: { hash: string, missing: LayerRange[], stuckAt: number | undefined, gap: number } | undefined
  for (const hash of [...groups.keys()].sort()) {
    const all = groups.get(hash) as StageHolder[]
    const usable = all.filter(h => !isOverloaded(h, ctx, p))
    const path = shortestChain(usable, ctx, p)
    if ('stages' in path) {
      if (chosen === undefined || path.cost < chosen.path.cost ||
        (path.cost === chosen.path.cost && path.stages.length < chosen.path.stages.length)) chosen = { hash, path }
      continue
    }
    const full = shortestChain(all, ctx, p)
    if (!('stages' in full)) {
      const missing = uncovered(all.map(h => h.layers), ctx.numLayers)
      const gap = missing.reduce((n, [a, b]) => n + b - a + 1, 0)
      const stuckAt = missing.length === 0 ? full.stuckAt : undefined
      if (closest === undefined || gap < closest.gap) closest = { hash, missing, stuckAt, gap }
    } else {
      overloadedHash ??= hash
    }
  }
  if (chosen !== undefined) {
    const kept = ctx.prefer === undefined ? undefined : preferredPath((groups.get(chosen.hash) as StageHolder[]).filter(h => !isOverloaded(h, ctx, p)), ctx.prefer.stages, ctx, p)
    if (kept !== undefined && kept.cost <= chosen.path.cost + Math.max(0, ctx.prefer!.slackMs)) {
      return { kind: 'chain', manifestHash: chosen.hash, stages: kept.stages, costMs: kept.cost }
    }
    return { kind: 'chain', manifestHash: chosen.hash, stages: chosen.path.stages, costMs: chosen.path.cost }
  }
  if (overloadedHash !== undefined) {
    return { kind: 'overloaded', manifestHash: overloadedHash, reason: `every complete chain of ${ctx.modelId} needs an overloaded stage` }
  }
  const c = closest as { hash: string, missing: LayerRange[], stuckAt: number | undefined }
  const reason = c.missing.length > 0
    ? `no node${ctx.kernels === undefined ? '' : ` running shoal's kernels ${ctx.kernels.join(', ')}`} holds layers ${c.missing.map(([a, b]) => a === b ? `${a}` : `${a}-${b}`).join(', ')} of ${ctx.modelId}`
    : `stages of ${ctx.modelId} overlap without meeting at layer ${c.stuckAt ?? 0}`
  return { kind: 'incomplete', manifestHash: c.hash, missing: c.missing, stuckAt: c.stuckAt, reason }
}
