/**
 * The speculative token source over a fake target and a fake draft model whose logits depend only
 * on the token at each position (tables), so every expectation is computable: the KV bookkeeping
 * (steps contiguous with the cache, rejected positions rolled back, never past the context or past
 * max_tokens), greedy output equal to the plain argmax chain, and the first sampled token of a
 * round distributed as the target's softmax through the whole path (draft sampling from q, the
 * verify step, acceptance, residual; with the residual left unnormalised the statistic is ~450).
 */
import { describe, expect, it } from 'vitest'
import { createRng, greedyVerdict, pickToken } from '../../daemon/engine/index.ts'
import type { StepOptions, StepOutput } from '../../daemon/engine/index.ts'
import { createPromptLookupDrafter, createSpeculativeSource, distribution, draftModelDrafter } from '../../daemon/speculative/index.ts'
import type { DraftSteps, TargetSequence } from '../../daemon/speculative/index.ts'

const V = 6

/** Logits rows by input token; a model whose next-token distribution depends on the last token only. */
function table (seed: number, peaked: Record<number, number> = {}): Float32Array[] {
  const rng = createRng(seed)
  return Array.from({ length: V }, (_, t) => {
    const row = Float32Array.from({ length: V }, () => 2 * (rng() - 0.5) * 2)
    if (peaked[t] !== undefined) row[peaked[t]] = 40
    return row
  })
}

/**
 * A sequence of a table model with a checked KV: steps must continue it, rollbacks shorten it.
 * `verdicts`: it checks a greedy verify itself, as the engine's worker does (a verdict, the
 * rejected positions dropped here); otherwise it returns a verify's logits as a target that knows
 * no verdicts does.
 */
function fakeSequence (rows: Float32Array[], maxPositions: number, verdicts = false) {
  const kv: number[] = []
  const log = { maxLength: 0, rollbacks: 0 }
  const step = async (tokenIds: number[], positions: number[], options: StepOptions): Promise<StepOutput> => {
    positions.forEach((p, i) => { if (p !== kv.length + i) throw new Error(`position ${p} does not continue a cache of ${kv.length}`) })
    kv.push(...tokenIds)
    if (kv.length > maxPositions) throw new Error(`cache of ${kv.length} is past the context`)
    log.maxLength = Math.max(log.maxLength, kv.length)
    const last = rows[tokenIds[tokenIds.length - 1]!]!
    if (options.pick !== undefined) return { kind: 'token', id: pickToken(last, options.pick) }
    const keep = options.logitsToKeep ?? 1
    const data = new Float32Array(keep * V)
    tokenIds.slice(-keep).forEach((t, i) => data.set(rows[t]!, i * V))
    if (verdicts && options.verify === 'greedy') {
      const { accepted, next } = greedyVerdict(tokenIds.slice(1), data, V)
      kv.length = positions[0]! + 1 + accepted
      return { kind: 'verdict', accepted, id: next }
    }
    return { kind: 'logits', data, count: keep, vocab: V }
  }
  const rollback = async (length: number): Promise<void> => {
    if (length > kv.length || length < 0) throw new Error(`rollback to ${length} of ${kv.length}`)
    kv.length = length
    log.rollbacks++
  }
  return { kv, log, step, rollback }
}

function setup (options: { k: number | 'adaptive', maxTokens?: number, maxPositions?: number, temperature?: number, seed?: number, targetSeed?: number, draftSeed?: number, soloOnly?: boolean, peers?: () => number }) {
  const maxPositions = options.maxPositions ?? 1000
  const targetRows = table(options.targetSeed ?? 1, { 1: 2 })
  const draftRows = table(options.draftSeed ?? 2, { 1: 2 })
  const target = fakeSequence(targetRows, maxPositions)
  const draftSeqs = new Map<string, ReturnType<typeof fakeSequence>>()
  const steps: DraftSteps = {
    async open (id) { draftSeqs.set(id, fakeSequence(draftRows, maxPositions)) },
    async step (id, tokenIds, positions, opts) { return await draftSeqs.get(id)!.step(tokenIds, positions, opts) },
    async rollback (id, length) { await draftSeqs.get(id)!.rollback(length) },
    async free (id) { draftSeqs.delete(id) },
  }
  /** Each target step's kind and how many run-ahead picks it was handed. */
  const calls: Array<{ kind: string, ahead: number | undefined }> = []
  const t: TargetSequence = {
    step: async (kind, ids, pos, opts) => { calls.push({ kind, ahead: opts.ahead?.length }); return await target.step(ids, pos, opts) },
    rollback: target.rollback,
  }
  const source = createSpeculativeSource({
    seqId: 's',
    target: t,
    drafter: draftModelDrafter('draft:fake', steps),
    sampling: { temperature: options.temperature ?? 0, topP: 1, ...(options.seed === undefined ? {} : { seed: options.seed }) },
    maxTokens: options.maxTokens,
    maxPositions,
    vocabSize: V,
    k: options.k,
    ...(options.soloOnly === undefined ? {} : { soloOnly: options.soloOnly }),
    ...(options.peers === undefined ? {} : { peers: options.peers }),
  })
  return { source, target, targetRows, draftSeqs, calls }
}

/** A table model's greedy next token after `t` (lowest id on ties). */
function argmaxAfter (rows: Float32Array[], t: number): number {
  let b = 0
  for (let v = 1; v < V; v++) if (rows[t]![v]! > rows[t]![b]!) b = v
  return b
}

/** Its greedy tokens after `t`, `n` of them: what plain decoding gives. */
function argmaxChain (rows: Float32Array[], t: number, n: number): number[] {
  const out: number[] = []
  for (let i = 0; i < n; i++) out.push(t = argmaxAfter(rows, t))
  return out
}

const signal = new AbortController().signal

/** Runs the source like the decode loop: prefill, then decode until `count` tokens or the context end. */
async function run (source: ReturnType<typeof setup>['source'], prompt: number[], count: number, maxPositions = Infinity): Promise<number[]> {
  const out = [await source.prefill(prompt, signal)]
  while (out.length < count && prompt.length + out.length < maxPositions) out.push(await source.decode(out[out.length - 1]!, prompt.length + out.length - 1, signal))
  return out
}

describe('speculative token source', () => {
  it('greedy output equals the plain argmax chain for every K, with the cache kept exact', async () => {
    const plain = argmaxChain(table(1, { 1: 2 }), 1, 30)
    for (const k of [1, 2, 4, 8, 'adaptive'] as const) {
      for (const draftSeed of [1, 2]) {
        const { source, target } = setup({ k, draftSeed })
        expect(await run(source, [0, 1], 30), `K=${k} draft seed ${draftSeed}`).toEqual(plain)
        // The cache holds the prompt and every token but the last (still to be fed), plus at most unverified drafts that the next round discards.
        expect(target.kv.slice(0, 31)).toEqual([0, 1, ...plain.slice(0, 29)])
        const c = source.counts()
        if (k !== 'adaptive' && draftSeed === 1) expect(c.accepted).toBe(c.drafted) // the target as its own draft
        if (draftSeed === 2 && k === 4) expect(target.log.rollbacks).toBeGreaterThan(0)
        await source.close()
      }
    }
  })

  it('over a target that checks greedy verifies itself: the same tokens, no rollback from the source, and a round hands picks on only where a miss leaves plain steps', async () => {
    const rows = table(1, { 1: 2 })
    const best = (t: number): number => argmaxAfter(rows, t)
    const plain = argmaxChain(rows, 1, 120)
    for (const [k, right] of [[4, true], [4, false], ['adaptive', true], ['adaptive', false]] as const) {
      const target = fakeSequence(rows, 10_000, true)
      const verifies: Array<number | undefined> = []
      let clock = 0
      // A step costs 10 ms plus 1 ms a position: a round that fails costs more than it yields.
      const t: TargetSequence = {
        step: async (_kind, ids, pos, opts) => {
          clock += 10 + ids.length
          if (opts.verify !== undefined) verifies.push(opts.ahead?.length)
          return await target.step(ids, pos, opts)
        },
        rollback: target.rollback,
      }
      // Drafts the target's own next tokens, or always a wrong one.
      const drafter = { name: 'fixed', open: async () => ({ propose: async ({ context, k: n }: { context: readonly number[], k: number }) => {
        const out: number[] = []
        let last = context[context.length - 1]!
        for (let i = 0; i < n; i++) { last = right ? best(last) : (best(last) + 1) % V; out.push(last) }
        return { tokens: out }
      }, close: async () => {} }) }
      const source = createSpeculativeSource({ seqId: 's', target: t, drafter, sampling: { temperature: 0, topP: 1 }, maxTokens: undefined, maxPositions: 10_000, vocabSize: V, k, now: () => clock })
      const out = [await source.prefill([0, 1], signal)]
      while (out.length < 120) out.push(await source.decode(out.at(-1)!, 1 + out.length, signal, 120 - out.length - 1))
      expect(out, `K ${k}, drafts ${right ? 'right' : 'wrong'}`).toEqual(plain)
      expect(target.log.rollbacks).toBe(0)
      expect(verifies.length).toBeGreaterThan(0)
      if (k === 4 || right) {
        // A fixed K verifies every step; drafts that stand keep adaptive K speculating.
        expect(verifies.every(a => a === undefined)).toBe(true)
      } else {
        // Adaptive K's first two rounds come before it decides (and its cost model may try a
        // short K once more); once it stays at 0 every round is a probe that, missing, leaves
        // plain steps, and the worker may run on with their picks.
        expect(verifies.slice(0, 2)).toEqual([undefined, undefined])
        expect(verifies.length).toBeGreaterThanOrEqual(5)
        expect(verifies.slice(-3)).toEqual([4, 4, 4])
      }
      await source.close()
    }
  })

  it('a solo-only source (the default prompt lookup) speculates alone and not beside batched peers', async () => {
    let peers = 3
    const beside = setup({ k: 'adaptive', draftSeed: 1, soloOnly: true, peers: () => peers })
    const tokens = await run(beside.source, [0, 1], 30)
    expect(beside.source.counts().rounds).toBe(0)
    peers = 0
    const alone = setup({ k: 'adaptive', draftSeed: 1, soloOnly: true, peers: () => peers })
    expect(await run(alone.source, [0, 1], 30)).toEqual(tokens)
    expect(alone.source.counts().rounds).toBeGreaterThan(0)
  })

  it('beside peers under the solo rule the prefill and the first plain step hand the target run-ahead picks; alone they hand none', async () => {
    const decodeAll = async (s: ReturnType<typeof setup>): Promise<number[]> => {
      const out = [await s.source.prefill([0, 1], signal, 11)]
      while (out.length < 12) out.push(await s.source.decode(out.at(-1)!, 1 + out.length, signal, 12 - out.length - 1))
      return out
    }
    const beside = setup({ k: 'adaptive', draftSeed: 1, soloOnly: true, peers: () => 2 })
    const tokens = await decodeAll(beside)
    expect(beside.calls.slice(0, 2)).toEqual([{ kind: 'prefill', ahead: 4 }, { kind: 'decode', ahead: 4 }])
    const alone = setup({ k: 'adaptive', draftSeed: 1, soloOnly: true, peers: () => 0 })
    expect(await decodeAll(alone)).toEqual(tokens)
    // Alone, a round may follow at once: the prefill hands nothing, and the first plain step measures a step.
    expect(alone.calls.slice(0, 2)).toEqual([{ kind: 'prefill', ahead: undefined }, { kind: 'decode', ahead: undefined }])
    // Never more picks than steps may follow.
    const short = setup({ k: 'adaptive', draftSeed: 1, soloOnly: true, peers: () => 2 })
    await short.source.prefill([0, 1], signal, 2)
    expect(short.calls[0]).toEqual({ kind: 'prefill', ahead: 2 })
  })

  it('never verifies past max_tokens or the context end', async () => {
    for (const maxTokens of [1, 2, 3, 6]) {
      const { source, target } = setup({ k: 8, maxTokens, draftSeed: 1 })
      await run(source, [0, 1], maxTokens)
      expect(target.log.maxLength).toBeLessThanOrEqual(2 + maxTokens)
    }
    const { source, target } = setup({ k: 8, maxPositions: 12, draftSeed: 1 })
    const out = await run(source, [0, 1, 3], 100, 12)
    expect(out).toHaveLength(9)
    expect(target.log.maxLength).toBeLessThanOrEqual(12)
  })

  it('the first sampled token of a round follows the target softmax (chi-square, through draft sampling, verify and residual)', async () => {
    const temperature = 1.3
    const N = 12_000
    const counts = new Array<number>(V).fill(0)
    for (let s = 0; s < N; s++) {
      const { source } = setup({ k: 3, temperature, seed: s })
      // Token 1 is followed by 2 with certainty (logit 40), so the round starts from a fixed prefix.
      const first = await source.prefill([0, 1], signal)
      expect(first).toBe(2)
      counts[await source.decode(2, 2, signal)]!++
      expect(source.counts().drafted).toBe(3)
    }
    const p = distribution(table(1, { 1: 2 })[2]!, { temperature, topP: 1 }, 0, V)
    let chi = 0
    for (let v = 0; v < V; v++) chi += (counts[v]! - N * p[v]!) ** 2 / (N * p[v]!)
    expect(chi).toBeLessThan(20.52) // df 5, significance 0.001
    // …and the draft's own distribution is far from it (the test can tell them apart).
    const q = distribution(table(2, { 1: 2 })[2]!, { temperature, topP: 1 }, 0, V)
    let chiQ = 0
    for (let v = 0; v < V; v++) chiQ += (counts[v]! - N * q[v]!) ** 2 / (N * q[v]!)
    expect(chiQ).toBeGreaterThan(200)
  })

  it('adaptive K drops to 0 where drafts never stand, and backs its probes off until one stands again', async () => {
    const rows = table(1, { 1: 2 })
    const best = (t: number): number => argmaxAfter(rows, t)
    const steps = 400
    const plain = argmaxChain(rows, 1, steps)
    /** Rounds over `steps` tokens: a drafter wrong at every token (right from `rightFrom` generated tokens on). */
    async function rounds (maxProbeEvery: number | undefined, rightFrom = Infinity): Promise<{ out: number[], rounds: number[], accepted: number }> {
      const target = fakeSequence(rows, 10_000)
      let clock = 0
      // A step costs 10 ms plus 1 ms a position: a failed round always costs more than it yields.
      const t: TargetSequence = { step: async (_kind, ids, pos, opts) => { clock += 10 + ids.length; return await target.step(ids, pos, opts) }, rollback: target.rollback }
      const at: number[] = []
      const source = createSpeculativeSource({
        seqId: 's',
        target: t,
        drafter: {
          name: 'fake',
          async open () {
            return {
              async propose ({ context, k }) {
                const generated = context.length - 2
                const tokens: number[] = []
                for (let i = 0, x = context[context.length - 1]!; i < k; i++) { const right = best(x); x = generated >= rightFrom ? right : (right + 1) % V; tokens.push(x) }
                return { tokens }
              },
              async close () {},
            }
          },
        },
        sampling: { temperature: 0, topP: 1 },
        maxTokens: undefined,
        maxPositions: 10_000,
        vocabSize: V,
        now: () => clock,
        ...(maxProbeEvery === undefined ? {} : { maxProbeEvery }),
        onRound: () => { at.push(target.kv.length) },
      })
      const out = await run(source, [0, 1], steps)
      const c = source.counts()
      await source.close()
      return { out, rounds: at, accepted: c.accepted }
    }
    const evenly = await rounds(16)
    const backedOff = await rounds(undefined)
    expect(evenly.out).toEqual(plain)
    expect(backedOff.out).toEqual(plain)
    // Evenly spaced probes: one every ~16 plain steps; backed off: 16, 32, 64, 128, 256 apart.
    expect(evenly.rounds.length).toBeGreaterThanOrEqual(20)
    expect(backedOff.rounds.length).toBeLessThanOrEqual(10)
    expect(evenly.accepted + backedOff.accepted).toBe(0)
    // A drafter that starts being right is found by the next probe, and K grows again.
    const recovers = await rounds(undefined, 150)
    expect(recovers.out).toEqual(plain)
    expect(recovers.accepted).toBeGreaterThan(100)
  })

  it('with run-ahead, a round waits until the worker holds no picks: it never throws away a step computed ahead', async () => {
    const rows = table(1, { 1: 2 })
    const plain = argmaxChain(rows, 1, 60)
    const target = fakeSequence(rows, 1000)
    // As the engine's worker: a plain step's picks let it run the next steps before they are asked
    // for (up to `heldTo`); a verify at a position it holds a pick for discards what it ran.
    let heldTo = -1
    const discarded: number[] = []
    let rounds = 0
    const t: TargetSequence = {
      step: async (_kind, ids, pos, opts) => {
        if (ids.length > 1) { rounds++; if (pos[0]! <= heldTo) discarded.push(pos[0]!) }
        if (opts.ahead !== undefined) heldTo = Math.max(heldTo, pos[0]! + opts.ahead.length)
        return await target.step(ids, pos, opts)
      },
      rollback: target.rollback,
    }
    const source = createSpeculativeSource({
      seqId: 's',
      target: t,
      drafter: createPromptLookupDrafter({ minNgram: 1 }),
      sampling: { temperature: 0, topP: 1 },
      maxTokens: undefined,
      maxPositions: 1000,
      vocabSize: V,
      runAhead: 4,
    })
    expect(await run(source, [0, 1], 60)).toEqual(plain)
    expect(rounds).toBeGreaterThan(3) // the argmax chain of a 6-token table cycles: lookup drafts
    expect(discarded).toEqual([])
    expect(source.counts().accepted).toBeGreaterThan(5)
    await source.close()
  })

  it('a seeded sampled run reproduces, adaptive K or not', async () => {
    for (const k of [3, 'adaptive'] as const) {
      const a = await run(setup({ k, temperature: 0.9, seed: 5 }).source, [0, 1], 40)
      const b = await run(setup({ k, temperature: 0.9, seed: 5 }).source, [0, 1], 40)
      expect(b).toEqual(a)
    }
  })
})
