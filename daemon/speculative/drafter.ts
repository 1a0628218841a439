/**
 * The drafter interface: something that proposes the next tokens of a sequence cheaply. A draft
 * model (daemon/speculative/draft-model.ts) and prompt lookup both implement it; the speculative
 * token source (source.ts) verifies whatever it proposes with one target step, so a drafter can
 * be wrong any amount without changing the output, only the speed.
 */
import type { SamplerParams } from '../engine/index.ts'
import type { Rng } from '../engine/index.ts'
import { promptLookup } from './prompt-lookup.ts'
import type { PromptLookupOptions } from './prompt-lookup.ts'

export interface Proposal {
  tokens: number[]
  /**
   * With sampling: the full-vocabulary distribution each token was drawn from. Absent: each token
   * is a point mass (named, not drawn), which speculative sampling handles exactly too.
   */
  q?: Float64Array[]
}

export interface DraftRequest {
  /** Every token of the sequence so far (prompt + generated), ending with the one not yet verified. */
  context: readonly number[]
  /** Tokens wanted (≥ 1); fewer (or none) is fine. */
  k: number
  /** The request's sampling: temperature 0 drafts greedily. */
  sampling: SamplerParams
  /** The sequence's seeded generator, for the draws of a sampling drafter. */
  rng: Rng
  signal: AbortSignal
}

/** One sequence's drafter. */
export interface SequenceDrafter {
  propose (request: DraftRequest): Promise<Proposal>
  /** Releases what it holds for the sequence (a draft model's KV). */
  close (): Promise<void>
}

/** Makes a drafter per sequence. */
export interface Drafter {
  /** Recorded in metrics and receipts: 'prompt-lookup' (or 'prompt-lookup (default)') or 'draft:<model id>'. */
  readonly name: string
  /** Runs the prompt through the drafter (a draft model prefills alongside the target). */
  open (seqId: string, promptIds: readonly number[], signal: AbortSignal): Promise<SequenceDrafter>
}

/** Prompt lookup as a Drafter: no state, no model. */
export function createPromptLookupDrafter (options: PromptLookupOptions & { name?: string } = {}): Drafter {
  return {
    name: options.name ?? 'prompt-lookup',
    async open () {
      return {
        async propose ({ context, k }) { return { tokens: promptLookup(context, k, options) } },
        async close () {},
      }
    },
  }
}
