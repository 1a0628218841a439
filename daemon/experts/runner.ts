/**
 * A reference runner for expert-parallel shards (shards/expert-shards.ts): embedding, every layer
 * (a MoE layer's experts through runExpertStep and an ExpertLink), head, with an explicit KV
 * cache, onnxruntime sessions on the calling thread, greedy decoding of a batch. Tests and
 * reproduction/ use it until the engine's stage runner calls runExpertStep between a MoE layer's
 * two halves itself; it is not how the daemon serves requests.
 */
import { join } from 'node:path'
import ort from 'onnxruntime-node'
import {
  ATTENTION_MASK, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, MOE_BASE, MOE_EXPERTS, MOE_INPUT, MOE_WEIGHTS,
  NUM_LOGITS_TO_KEEP, pastKeyName, pastValueName, POSITION_IDS, presentKeyName, presentValueName, type ExpertShardLayout,
} from '../../shards/index.ts'
import type { ExpertPlan } from './placement.ts'
import { runExpertStep, type ExpertLink } from './step.ts'

export interface ExpertParallelRunnerInit {
  dir: string
  layout: ExpertShardLayout
  plan: ExpertPlan
  /** The model key frames carry (the manifest hash). */
  model: string
  link: ExpertLink
  threads?: number
  /** Bound on one MoE step, holders included (default 10 s). */
  stepTimeoutMs?: number
}

export interface GreedyResult {
  tokens: number[][]
  /** Mean payload bytes on the wire per decode step (all rows of the batch; frames both ways). */
  decodeBytes: number
  /** Row 0's logits at every step. */
  logits: Float32Array[]
}

export interface ExpertParallelRunner {
  open: () => Promise<void>
  close: () => Promise<void>
  /** Greedy decode of several prompts as one batch (left-padded prefill, then one token per row per step). */
  greedy: (prompts: number[][], n: number, onToken?: (i: number) => void) => Promise<GreedyResult>
  /** Holders this runner stopped using (failed mid-step); their replicas took over. */
  readonly exclude: Set<string>
}

const i64 = (v: number[], dims: number[]): ort.Tensor => new ort.Tensor('int64', BigInt64Array.from(v.map(BigInt)), dims)

export function createExpertParallelRunner (init: ExpertParallelRunnerInit): ExpertParallelRunner {
  const { layout, plan } = init
  const sessions = new Map<string, ort.InferenceSession>()
  const exclude = new Set<string>()
  let step = 0
  let bytes = 0

  async function run (ids: number[], pos: number[], mask: number[], B: number, S: number, past: Map<string, ort.Tensor>): Promise<Float32Array> {
    const { hiddenSize: D, moe } = layout.shape
    let x = (await sessions.get(layout.embed)!.run({ [INPUT_IDS]: i64(ids, [B, S]) }))[HIDDEN_OUT]!
    for (const l of layout.layers) {
      const out = await sessions.get(l.graph)!.run({
        [HIDDEN_IN]: x, [POSITION_IDS]: i64(pos, [B, S]), [ATTENTION_MASK]: i64(mask, [B, mask.length / B]),
        [pastKeyName(l.layer)]: past.get(pastKeyName(l.layer))!, [pastValueName(l.layer)]: past.get(pastValueName(l.layer))!,
      })
      past.set(pastKeyName(l.layer), out[presentKeyName(l.layer)]!)
      past.set(pastValueName(l.layer), out[presentValueName(l.layer)]!)
      if (l.experts === undefined) { x = out[HIDDEN_OUT]!; continue }
      const r = await runExpertStep({
        model: init.model, step: step++, placement: plan.layers.find(p => p.layer === l.layer)!, rows: B * S, width: D,
        base: out[MOE_BASE]!.data as Float32Array, input: out[MOE_INPUT]!.data as Float32Array,
        experts: out[MOE_EXPERTS]!.data as BigInt64Array, weights: out[MOE_WEIGHTS]!.data as Float32Array, topK: moe!.topK,
        exclude, signal: AbortSignal.timeout(init.stepTimeoutMs ?? 10_000),
      }, init.link)
      bytes += r.bytesOut + r.bytesIn
      x = new ort.Tensor('float32', r.out, [B, S, D])
    }
    const logits = await sessions.get(layout.head)!.run({ [HIDDEN_IN]: x, [NUM_LOGITS_TO_KEEP]: i64([1], []) })
    return logits[LOGITS]!.data as Float32Array
  }

  return {
    exclude,
    async open () {
      for (const g of [layout.embed, layout.head, ...layout.layers.map(l => l.graph)]) {
        sessions.set(g, await ort.InferenceSession.create(join(init.dir, g), { intraOpNumThreads: init.threads ?? 1, interOpNumThreads: 1 }))
      }
    },
    async close () {
      for (const s of sessions.values()) await s.release()
      sessions.clear()
    },
    async greedy (prompts, n, onToken) {
      const B = prompts.length
      const S = Math.max(...prompts.map(r => r.length))
      const pad = prompts.map(r => S - r.length)
      const { numKvHeads: kvH, headDim: hd } = layout.shape
      const past = new Map<string, ort.Tensor>()
      for (const l of layout.layers) for (const name of [pastKeyName(l.layer), pastValueName(l.layer)]) past.set(name, new ort.Tensor('float32', new Float32Array(0), [B, kvH, 0, hd]))
      let mask = prompts.flatMap((_, b) => Array.from({ length: S }, (_, j) => (j < pad[b]! ? 0 : 1)))
      let logits = await run(prompts.flatMap((r, b) => [...new Array<number>(pad[b]!).fill(0), ...r]), prompts.flatMap((_, b) => Array.from({ length: S }, (_, j) => Math.max(0, j - pad[b]!))), mask, B, S, past)
      const tokens: number[][] = prompts.map(() => [])
      const first: Float32Array[] = []
      const afterPrefill = bytes
      for (let i = 0; i < n; i++) {
        const V = logits.length / B
        first.push(logits.slice(0, V))
        const next = prompts.map((_, b) => { let best = 0; for (let j = 1; j < V; j++) if (logits[b * V + j]! > logits[b * V + best]!) best = j; return best })
        next.forEach((t, b) => tokens[b]!.push(t))
        onToken?.(i)
        if (i + 1 === n) break
        const cols = mask.length / B
        mask = prompts.flatMap((_, b) => [...mask.slice(b * cols, (b + 1) * cols), 1])
        logits = await run(next, prompts.map(r => r.length + i), mask, B, 1, past)
      }
      return { tokens, decodeBytes: (bytes - afterPrefill) / Math.max(1, n - 1), logits: first }
    },
  }
}
