/**
 * Test helpers: the stage side of expert-parallel shards run directly with onnxruntime (embed,
 * every layer, MoE layers through runExpertStep and an ExpertLink, head; explicit KV cache), and
 * holders started from an expert plan.
 */
import { join } from 'node:path'
import ort from 'onnxruntime-node'
import { createExpertHolder, expertBytes, placeExperts, runExpertStep, type ExpertHolder, type ExpertLink, type ExpertPlan } from '../../daemon/experts/index.ts'
import {
  ATTENTION_MASK, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, MOE_BASE, MOE_EXPERTS, MOE_INPUT, MOE_WEIGHTS,
  NUM_LOGITS_TO_KEEP, pastKeyName, pastValueName, POSITION_IDS, presentKeyName, presentValueName, type ExpertShardLayout,
} from '../../shards/index.ts'
import { i64 } from '../shards/pipeline.ts'

export const MODEL = 'manifest-hash-of-the-test-model'

/** The stage: embed, every layer (MoE ones through the holders), head; an explicit KV cache. */
export class SpreadStage {
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
  async greedy (prompts: number[][], n: number, onToken?: (i: number) => void): Promise<{ tokens: number[][], decodeBytes: number, logits: Float32Array[] }> {
    const B = prompts.length
    const S = Math.max(...prompts.map(r => r.length))
    const pad = prompts.map(r => S - r.length)
    const { numKvHeads: kvH, headDim: hd } = this.layout.shape
    const past = new Map<string, ort.Tensor>()
    for (const l of this.layout.layers) for (const name of [pastKeyName(l.layer), pastValueName(l.layer)]) past.set(name, new ort.Tensor('float32', new Float32Array(0), [B, kvH, 0, hd]))
    let mask = prompts.flatMap((_, b) => Array.from({ length: S }, (_, j) => (j < pad[b]! ? 0 : 1)))
    let logits = await this.run(prompts.flatMap((r, b) => [...new Array<number>(pad[b]!).fill(0), ...r]), prompts.flatMap((_, b) => Array.from({ length: S }, (_, j) => Math.max(0, j - pad[b]!))), mask, B, S, past)
    const tokens: number[][] = prompts.map(() => [])
    const first: Float32Array[] = []
    const afterPrefill = this.bytes
    for (let step = 0; step < n; step++) {
      const V = logits.length / B
      first.push(logits.slice(0, V))
      const next = prompts.map((_, b) => { let best = 0; for (let j = 1; j < V; j++) if (logits[b * V + j]! > logits[b * V + best]!) best = j; return best })
      next.forEach((t, b) => tokens[b]!.push(t))
      onToken?.(step)
      if (step + 1 === n) break
      const cols = mask.length / B
      mask = prompts.flatMap((_, b) => [...mask.slice(b * cols, (b + 1) * cols), 1])
      logits = await this.run(next, prompts.map(r => r.length + step), mask, B, 1, past)
    }
    return { tokens, decodeBytes: (this.bytes - afterPrefill) / Math.max(1, n - 1), logits: first }
  }
}

export async function startHolders (dir: string, layout: ExpertShardLayout, plan: ExpertPlan): Promise<Map<string, ExpertHolder>> {
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
export function linkTo (holders: Map<string, ExpertHolder>, dead: Set<string>): ExpertLink {
  return async (peerId, parts) => {
    if (dead.has(peerId)) throw Object.assign(new Error(`holder ${peerId} is gone`), { code: 'SHOAL_ERR_PEER_LOST' })
    return await holders.get(peerId)!.handle(Uint8Array.from(parts.flatMap(p => [...p])))
  }
}

export function planFor (layout: ExpertShardLayout, holders: number | string[], opts: { hotFactor?: number, maxReplicas?: number } = {}): ExpertPlan {
  const moe = layout.shape.moe!
  const bytes = expertBytes(layout.shape, { kind: 'none' })
  const d = placeExperts({
    moeLayers: moe.moeLayers, numExperts: moe.numExperts, expertBytes: bytes,
    nodes: (typeof holders === 'number' ? Array.from({ length: holders }, (_, i) => `holder-${i}`) : holders).map(peerId => ({ peerId, freeBytes: 1000 * bytes })), ...opts,
  })
  if (d.kind !== 'plan') throw new Error(d.reason)
  return d.plan
}
