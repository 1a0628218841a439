/**
 * Experts spread over holder nodes: a MoE checkpoint compiled to expert-parallel shards runs with
 * the stage doing attention and the router and 1, 2 or 3 holders (placed by placeExperts) doing
 * the experts, every row crossing as /shoal/experts frames (encoded, decoded, answered by a real
 * holder with onnxruntime sessions). Greedy tokens equal the float64 reference's for single and
 * batched streams; a dead holder's replica takes over mid-sequence; with no replica the step fails
 * with a typed error instead of hanging. Bytes on the wire per decode token are reported.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import ort from 'onnxruntime-node'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createExpertHolder, expertBytes, placeExperts, runExpertStep, type ExpertHolder, type ExpertLink, type ExpertPlan } from '../../daemon/experts/index.ts'
import {
  ATTENTION_MASK, compileExpertShards, generateTestModel, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, MOE_BASE, MOE_EXPERTS, MOE_INPUT, MOE_WEIGHTS,
  NUM_LOGITS_TO_KEEP, pastKeyName, pastValueName, POSITION_IDS, presentKeyName, presentValueName, type ExpertShardLayout, type MoeTestArchitecture,
} from '../../shards/index.ts'
import { encodePrompt, i64 } from '../shards/pipeline.ts'
import { ReferenceModel } from '../support/reference.ts'

const N = 32
const TEXTS = ['The quick brown fox jumps over the lazy dog. Once upon a time', 'Once', 'A lazy dog and a quick brown fox']
const MODEL = 'manifest-hash-of-the-test-model'

/** The stage: embed, every layer (MoE ones through the holders), head; an explicit KV cache. */
class SpreadStage {
  private readonly sessions = new Map<string, ort.InferenceSession>()
  step = 0
  bytes = 0
  readonly exclude = new Set<string>()
  readonly dir: string
  readonly layout: ExpertShardLayout
  readonly plan: ExpertPlan
  readonly link: ExpertLink
  constructor (dir: string, layout: ExpertShardLayout, plan: ExpertPlan, link: ExpertLink) {
    this.dir = dir
    this.layout = layout
    this.plan = plan
    this.link = link
  }

  async open (): Promise<void> {
    for (const g of [this.layout.embed, this.layout.head, ...this.layout.layers.map(l => l.graph)]) {
      this.sessions.set(g, await ort.InferenceSession.create(join(this.dir, g), { intraOpNumThreads: 1, interOpNumThreads: 1 }))
    }
  }

  async close (): Promise<void> { for (const s of this.sessions.values()) await s.release() }

  async run (ids: number[], pos: number[], mask: number[], B: number, S: number, past: Map<string, ort.Tensor>): Promise<Float32Array> {
    const { hiddenSize: D, moe } = this.layout.shape
    let x = (await this.sessions.get(this.layout.embed)!.run({ [INPUT_IDS]: i64(ids, [B, S]) }))[HIDDEN_OUT]!
    for (const l of this.layout.layers) {
      const out = await this.sessions.get(l.graph)!.run({
        [HIDDEN_IN]: x, [POSITION_IDS]: i64(pos, [B, S]), [ATTENTION_MASK]: i64(mask, [B, mask.length / B]),
        [pastKeyName(l.layer)]: past.get(pastKeyName(l.layer))!, [pastValueName(l.layer)]: past.get(pastValueName(l.layer))!,
      })
      past.set(pastKeyName(l.layer), out[presentKeyName(l.layer)]!)
      past.set(pastValueName(l.layer), out[presentValueName(l.layer)]!)
      if (l.experts === undefined) { x = out[HIDDEN_OUT]!; continue }
      const r = await runExpertStep({
        model: MODEL, step: this.step++, placement: this.plan.layers.find(p => p.layer === l.layer)!, rows: B * S, width: D,
        base: out[MOE_BASE]!.data as Float32Array, input: out[MOE_INPUT]!.data as Float32Array,
        experts: out[MOE_EXPERTS]!.data as BigInt64Array, weights: out[MOE_WEIGHTS]!.data as Float32Array, topK: moe!.topK,
        exclude: this.exclude, signal: AbortSignal.timeout(10_000),
      }, this.link)
      this.bytes += r.bytesOut + r.bytesIn
      x = new ort.Tensor('float32', r.out, [B, S, D])
    }
    const logits = await this.sessions.get(this.layout.head)!.run({ [HIDDEN_IN]: x, [NUM_LOGITS_TO_KEEP]: i64([1], []) })
    return logits[LOGITS]!.data as Float32Array
  }

  /** Greedy decode of several prompts as one batch (left-padded prefill, then one token per row per step). */
  async greedy (prompts: number[][], n: number, onToken?: (i: number) => void): Promise<{ tokens: number[][], decodeBytes: number }> {
    const B = prompts.length
    const S = Math.max(...prompts.map(r => r.length))
    const pad = prompts.map(r => S - r.length)
    const { numKvHeads: kvH, headDim: hd } = this.layout.shape
    const past = new Map<string, ort.Tensor>()
    for (const l of this.layout.layers) for (const name of [pastKeyName(l.layer), pastValueName(l.layer)]) past.set(name, new ort.Tensor('float32', new Float32Array(0), [B, kvH, 0, hd]))
    let mask = prompts.flatMap((_, b) => Array.from({ length: S }, (_, j) => (j < pad[b]! ? 0 : 1)))
    let logits = await this.run(prompts.flatMap((r, b) => [...new Array<number>(pad[b]!).fill(0), ...r]), prompts.flatMap((_, b) => Array.from({ length: S }, (_, j) => Math.max(0, j - pad[b]!))), mask, B, S, past)
    const tokens: number[][] = prompts.map(() => [])
    const afterPrefill = this.bytes
    for (let step = 0; step < n; step++) {
      const V = logits.length / B
      const next = prompts.map((_, b) => { let best = 0; for (let j = 1; j < V; j++) if (logits[b * V + j]! > logits[b * V + best]!) best = j; return best })
      next.forEach((t, b) => tokens[b]!.push(t))
      onToken?.(step)
      if (step + 1 === n) break
      const cols = mask.length / B
      mask = prompts.flatMap((_, b) => [...mask.slice(b * cols, (b + 1) * cols), 1])
      logits = await this.run(next, prompts.map(r => r.length + step), mask, B, 1, past)
    }
    return { tokens, decodeBytes: (this.bytes - afterPrefill) / Math.max(1, n - 1) }
  }
}

async function startHolders (dir: string, layout: ExpertShardLayout, plan: ExpertPlan): Promise<Map<string, ExpertHolder>> {
  const holders = new Map<string, ExpertHolder>()
  for (const node of plan.nodes) {
    const experts = plan.layers.flatMap(l => l.holders.flatMap((hs, expert) => hs.includes(node.peerId) ? [{ layer: l.layer, expert }] : []))
    const h = createExpertHolder({ dir, layout, model: MODEL, experts })
    await h.start()
    holders.set(node.peerId, h)
  }
  return holders
}

/** In-process links: the frame's bytes go to the holder's handle(); a dead holder's link fails. */
function linkTo (holders: Map<string, ExpertHolder>, dead: Set<string>): ExpertLink {
  return async (peerId, parts) => {
    if (dead.has(peerId)) throw Object.assign(new Error(`holder ${peerId} is gone`), { code: 'SHOAL_ERR_PEER_LOST' })
    return await holders.get(peerId)!.handle(Uint8Array.from(parts.flatMap(p => [...p])))
  }
}

function planFor (layout: ExpertShardLayout, holders: number, opts: { hotFactor?: number, maxReplicas?: number } = {}): ExpertPlan {
  const moe = layout.shape.moe!
  const bytes = expertBytes(layout.shape, { kind: 'none' })
  const d = placeExperts({
    moeLayers: moe.moeLayers, numExperts: moe.numExperts, expertBytes: bytes,
    nodes: Array.from({ length: holders }, (_, i) => ({ peerId: `holder-${i}`, freeBytes: 1000 * bytes })), ...opts,
  })
  if (d.kind !== 'plan') throw new Error(d.reason)
  return d.plan
}

describe.each(['qwen2-moe', 'mixtral'] as MoeTestArchitecture[])('%s with experts on holders', (arch) => {
  let root: string
  let dir: string
  let layout: ExpertShardLayout
  let prompts: number[][]
  let want: number[][]

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-spread-'))
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: arch, outDir: ckpt, seed: 4 })
    dir = join(root, 'experts')
    layout = await compileExpertShards({ modelDir: ckpt, outDir: dir })
    prompts = await Promise.all(TEXTS.map(async t => await encodePrompt(ckpt, t)))
    want = prompts.map(p => new ReferenceModel(ckpt).greedy(p, N).tokens)
    expect(new Set(want[0]).size).toBeGreaterThan(6)
  }, 120_000)
  afterAll(async () => { await rm(root, { recursive: true, force: true }) })

  it.each([1, 2, 3])('%i holder(s): single and batched streams match the float64 reference', async (n) => {
    const plan = planFor(layout, n)
    const holders = await startHolders(dir, layout, plan)
    const stage = new SpreadStage(dir, layout, plan, linkTo(holders, new Set()))
    await stage.open()
    try {
      const single = await stage.greedy([prompts[0]!], N)
      expect(single.tokens).toEqual([want[0]])
      expect((await stage.greedy(prompts, N)).tokens).toEqual(want)
      const busy = [...holders.values()].filter(h => h.stats().steps > 0).length
      console.log(`${arch}, ${n} holder(s): ${single.decodeBytes.toFixed(0)} bytes on the wire per decode token (one stream; frames both ways), ${busy} holders used`)
      expect(busy).toBe(n)
    } finally {
      await stage.close()
      for (const h of holders.values()) await h.stop()
    }
  }, 120_000)

  it('a holder dies mid-sequence: its replicas take over and the tokens do not change', async () => {
    // hotFactor 0: every expert is hot, so each has a copy on two of the three holders.
    const plan = planFor(layout, 3, { hotFactor: 0, maxReplicas: 2 })
    expect(plan.layers.every(l => l.holders.every(h => h.length === 2))).toBe(true)
    const holders = await startHolders(dir, layout, plan)
    const dead = new Set<string>()
    const stage = new SpreadStage(dir, layout, plan, linkTo(holders, dead))
    await stage.open()
    try {
      let stepsAtDeath = 0
      const got = await stage.greedy(prompts, N, (i) => { if (i === 8) { dead.add('holder-1'); stepsAtDeath = holders.get('holder-1')!.stats().steps } })
      expect(got.tokens).toEqual(want)
      expect(stage.exclude.has('holder-1')).toBe(true)
      expect(holders.get('holder-1')!.stats().steps).toBe(stepsAtDeath)
    } finally {
      await stage.close()
      for (const h of holders.values()) await h.stop()
    }
  }, 120_000)

  it('a holder dies and no copy of an expert is left: the step fails cleanly with SHOAL_ERR_PEER_LOST', async () => {
    const plan = planFor(layout, 2, { maxReplicas: 1 })
    const holders = await startHolders(dir, layout, plan)
    const dead = new Set<string>()
    const stage = new SpreadStage(dir, layout, plan, linkTo(holders, dead))
    await stage.open()
    try {
      const err = await stage.greedy([prompts[0]!], N, (i) => { if (i === 3) dead.add('holder-0') }).catch((e: unknown) => e)
      expect((err as { code?: string }).code).toBe('SHOAL_ERR_PEER_LOST')
      expect((err as { name?: string }).name).toBe('ExpertsLostError')
    } finally {
      await stage.close()
      for (const h of holders.values()) await h.stop()
    }
  }, 120_000)
})
