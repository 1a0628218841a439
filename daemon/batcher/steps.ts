/**
 * One step's bookkeeping around chunking: checking what a caller submits, cutting a chunk's input
 * rows and positions, and joining chunk outputs back into the step's one result.
 */
import { BadStepError, BatchFailedError } from './errors.ts'
import type { StepInput, StepRequest, StepResult } from './types.ts'

/** Throws BadStepError naming what is wrong. */
export function checkStep (step: StepRequest): void {
  if (typeof step !== 'object' || step === null) throw new BadStepError('step must be an object')
  if (typeof step.seqId !== 'string' || step.seqId.length === 0) throw new BadStepError('step.seqId must be a non-empty string')
  if (step.kind !== 'prefill' && step.kind !== 'decode') throw new BadStepError('step.kind must be "prefill" or "decode"')
  const n = Array.isArray(step.positions) ? step.positions.length : 0
  if (n === 0) throw new BadStepError('step.positions must be a non-empty array')
  if (!step.positions.every(p => Number.isSafeInteger(p) && p >= 0)) throw new BadStepError('step.positions must be non-negative integers')
  if (step.budgetMs !== undefined && !(step.budgetMs >= 0)) throw new BadStepError('step.budgetMs must be ≥ 0')
  if (step.reach !== undefined && !(Number.isSafeInteger(step.reach) && step.reach >= 0)) throw new BadStepError('step.reach must be a non-negative integer')
  const input = step.input as Partial<{ tokenIds: unknown, hidden: unknown }> | undefined
  if (input !== undefined && Array.isArray(input.tokenIds)) {
    if (input.tokenIds.length !== n) throw new BadStepError(`step.input.tokenIds has ${input.tokenIds.length} ids for ${n} positions`)
    if (!input.tokenIds.every(t => Number.isSafeInteger(t) && (t as number) >= 0)) throw new BadStepError('step.input.tokenIds must be non-negative integers')
  } else if (input !== undefined && input.hidden instanceof Float32Array) {
    if (input.hidden.length === 0 || input.hidden.length % n !== 0) throw new BadStepError(`step.input.hidden has ${input.hidden.length} values, not a whole number of rows for ${n} positions`)
  } else {
    throw new BadStepError('step.input must be {tokenIds: number[]} or {hidden: Float32Array}')
  }
  const k = step.logitsToKeep ?? 1
  if (!Number.isSafeInteger(k) || k < 1 || k > n) throw new BadStepError(`step.logitsToKeep must be an integer in 1..${n}, got ${k}`)
  if (step.pick !== undefined && k !== 1) throw new BadStepError('step.pick returns one token: logitsToKeep must be 1')
}

/** Rows [offset, offset + count) of a step's input (the input itself when that is all of it). */
export function sliceInput (input: StepInput, offset: number, count: number, total: number): StepInput {
  if (offset === 0 && count === total) return input
  if ('tokenIds' in input) return { tokenIds: input.tokenIds.slice(offset, offset + count) }
  const width = input.hidden.length / total
  return { hidden: input.hidden.subarray(offset * width, (offset + count) * width) }
}

/**
 * Logits a chunk [offset, offset + count) of a `total`-position step must return so that the step
 * gets its last `keep` positions: `use` rows are wanted (a suffix of the chunk); the executor is
 * asked for at least one.
 */
export function logitsWindow (total: number, keep: number, offset: number, count: number): { ask: number, use: number } {
  const use = Math.max(0, offset + count - Math.max(offset, total - keep))
  return { ask: Math.max(1, use), use }
}

/** Collects chunk outputs; `finish` joins them into the step's result. */
export class StepAssembly {
  private readonly parts: StepResult[] = []

  /** `use`: logits rows wanted from this chunk; `rows`: the chunk's positions (all hidden rows are kept). */
  add (output: StepResult, use: number, rows: number): void {
    if (output.kind === 'token') {
      // Only the final chunk of a step submitted with `pick` asks for one.
      if (!Number.isSafeInteger(output.id) || output.id < 0 || use !== 1) throw new BatchFailedError('executor returned a malformed or unasked-for token')
      this.parts.push(output)
      return
    }
    if (output.kind === 'verdict') {
      // Only a verify that ran whole (one chunk, every row kept) gets one.
      if (!Number.isSafeInteger(output.id) || output.id < 0 || !Number.isSafeInteger(output.accepted) || output.accepted < 0 || output.accepted >= rows || use !== rows || this.parts.length > 0) {
        throw new BatchFailedError('executor returned a malformed or unasked-for verdict')
      }
      this.parts.push(output)
      return
    }
    const width = output.kind === 'logits' ? output.vocab : output.hidden
    if (!(output.data instanceof Float32Array) || !Number.isSafeInteger(width) || width < 1 || output.data.length !== output.count * width) {
      throw new BatchFailedError(`executor returned a malformed ${String(output.kind)} output`)
    }
    const first = this.parts[0]
    if (first !== undefined && (first.kind !== output.kind || (first.kind === 'logits' ? first.vocab : first.kind === 'hidden' ? first.hidden : 0) !== width)) {
      throw new BatchFailedError('executor returned chunk outputs of different kinds or widths for one step')
    }
    if (output.kind === 'hidden') {
      if (output.count !== rows) throw new BatchFailedError(`executor returned ${output.count} hidden rows for ${rows} positions`)
      this.parts.push(output)
      return
    }
    if (use === 0) return
    if (output.count < use) throw new BatchFailedError(`executor returned ${output.count} logits rows, ${use} were asked for`)
    this.parts.push(output.count === use ? output : { ...output, count: use, data: output.data.subarray((output.count - use) * width) })
  }

  finish (): StepResult {
    const first = this.parts[0]
    if (first === undefined) throw new BatchFailedError('no output for step')
    if (this.parts.length === 1) return first
    const rows = this.parts.filter(p => p.kind === 'logits' || p.kind === 'hidden')
    if (rows.length !== this.parts.length || first.kind === 'token' || first.kind === 'verdict') throw new BatchFailedError('executor returned a token beside other outputs for one step')
    const count = rows.reduce((sum, p) => sum + p.count, 0)
    const data = new Float32Array(rows.reduce((sum, p) => sum + p.data.length, 0))
    let at = 0
    for (const p of rows) { data.set(p.data, at); at += p.data.length }
    return { ...first, data, count }
  }
}
