/**
 * A reference runner for expert-parallel shards over a fixed plan: greedy decoding of a batch of
 * prompts through the same forward pass the daemon's service runs (forward.ts: each sequence's
 * attention over its own KV, each MoE layer's rows of the batch in one runExpertStep over an
 * ExpertLink). Tests and reproduction/ use it to drive holders without a daemon.
 */
import type { ExpertShardLayout } from '../../shards/index.ts'
import { argmax } from '../engine/index.ts'
import { createExpertForward, type ExpertsOfLayer } from './forward.ts'
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
  /** shoal's kernel library the graphs load (LoadOptions.kernels); absent: onnxruntime's kernels. */
  kernels?: string
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
  /** Greedy decode of several prompts as one batch (their prefills in one wave, then one token per prompt per step). */
  greedy: (prompts: number[][], n: number, onToken?: (i: number) => void) => Promise<GreedyResult>
  /** Holders this runner stopped using (failed mid-step); their replicas took over. */
  readonly exclude: Set<string>
}

export function createExpertParallelRunner (init: ExpertParallelRunnerInit): ExpertParallelRunner {
  const { layout, plan } = init
  const forward = createExpertForward({ dir: init.dir, layout, ...(init.threads === undefined ? {} : { threads: init.threads }), ...(init.kernels === undefined ? {} : { kernels: init.kernels }) })
  const exclude = new Set<string>()
  let step = 0
  let bytes = 0

  const experts: ExpertsOfLayer = async (layer, rows, base, input, ids, weights) => {
    const r = await runExpertStep({
      model: init.model, step: step++, placement: plan.layers.find(p => p.layer === layer)!, rows, width: layout.shape.hiddenSize,
      base, input, experts: ids, weights, topK: layout.shape.moe!.topK,
      exclude, signal: AbortSignal.timeout(init.stepTimeoutMs ?? 10_000),
    }, init.link)
    bytes += r.bytesOut + r.bytesIn
    return r.out
  }

  return {
    exclude,
    open: forward.open,
    close: forward.close,
    async greedy (prompts, n, onToken) {
      const seqs = prompts.map(() => forward.newSequence())
      let logits = await forward.run(prompts.map((ids, b) => ({ seq: seqs[b]!, ids })), experts)
      const tokens: number[][] = prompts.map(() => [])
      const first: Float32Array[] = []
      const afterPrefill = bytes
      for (let i = 0; i < n; i++) {
        first.push(logits[0]!.slice())
        const next = logits.map(l => argmax(l))
        next.forEach((t, b) => tokens[b]!.push(t))
        onToken?.(i)
        if (i + 1 === n) break
        logits = await forward.run(next.map((t, b) => ({ seq: seqs[b]!, ids: [t] })), experts)
      }
      return { tokens, decodeBytes: (bytes - afterPrefill) / Math.max(1, n - 1), logits: first }
    },
  }
}
