/**
 * Greedy decoding through a batching stage engine (its worker), a sequence alone and several in
 * one batch a step: what the batch-invariance tests compare.
 */
import { argmax, GREEDY_PICK as GREEDY } from '../../daemon/engine/index.ts'
import type { BatchingStageEngine, PrefixKeepingRunner, StepOutput } from '../../daemon/engine/index.ts'

export const tokenOf = (out: StepOutput): number => {
  if (out.kind !== 'token') throw new Error(`expected a token, got ${out.kind}`)
  return out.id
}

/** A logits step's [count, vocab] rows as they came. */
export const logitsOf = (out: StepOutput): Float32Array => {
  if (out.kind !== 'logits') throw new Error(`expected logits, got ${out.kind}`)
  return out.data
}

/** A logits step's rows, one array each (its last `count` positions). */
export const logitRows = (out: StepOutput): Float32Array[] => {
  if (out.kind !== 'logits') throw new Error(`expected logits, got ${out.kind}`)
  return Array.from({ length: out.count }, (_, i) => out.data.slice(i * out.vocab, (i + 1) * out.vocab))
}

/** Whether two arrays hold the same floats bit for bit. */
export const sameBits = (a: Float32Array, b: Float32Array): boolean =>
  Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(Buffer.from(b.buffer, b.byteOffset, b.byteLength))

/** `tokens` greedy tokens after `prompt`, the sequence alone on the engine. */
export async function greedyAlone (engine: BatchingStageEngine, prompt: number[], tokens: number): Promise<number[]> {
  const seq = await engine.open()
  let t = tokenOf(await engine.step(seq, { tokenIds: prompt }, prompt.map((_, i) => i), { pick: GREEDY }))
  const ids = [t]
  while (ids.length < tokens) {
    t = tokenOf(await engine.step(seq, { tokenIds: [t] }, [prompt.length + ids.length - 1], { pick: GREEDY }))
    ids.push(t)
  }
  await engine.free(seq)
  return ids
}

/** `tokens` greedy tokens after each prompt, every step of all of them in one stepBatch. */
export async function greedyTogether (engine: BatchingStageEngine, prompts: number[][], tokens: number): Promise<number[][]> {
  const seqs = await Promise.all(prompts.map(async (_, i) => await engine.open(`b-${i}`)))
  const together: number[][] = prompts.map(() => [])
  let items = prompts.map((p, i) => ({ seqId: seqs[i]!, input: { tokenIds: p }, positions: p.map((_, k) => k), pick: GREEDY }))
  for (let step = 0; step < tokens; step++) {
    const results = await engine.stepBatch(items)
    results.forEach((r, i) => {
      if (!('output' in r)) throw r.error
      together[i]!.push(tokenOf(r.output))
    })
    items = prompts.map((p, i) => ({ seqId: seqs[i]!, input: { tokenIds: [together[i]!.at(-1)!] }, positions: [p.length + step], pick: GREEDY }))
  }
  for (const s of seqs) await engine.free(s)
  return together
}

/** Positions from, from + 1, … (n of them). */
export const positions = (from: number, n: number): BigInt64Array => BigInt64Array.from({ length: n }, (_, i) => BigInt(from + i))

/** A logits step's last row. */
const lastLogits = (o: StepOutput): Float32Array => { if (o.kind !== 'logits') throw new Error(`expected logits, got ${o.kind}`); return o.data.subarray((o.count - 1) * o.vocab) }

/** `steps` greedy tokens after `prompt` from a stage runner's logits (argmax in JS), the sequence alone: the reference of the greedy-token tests. */
export async function greedyByLogits (runner: PrefixKeepingRunner, seqId: string, prompt: bigint[], steps: number): Promise<number[]> {
  runner.open(seqId)
  let o = await runner.step(seqId, { kind: 'tokens', ids: BigInt64Array.from(prompt) }, positions(0, prompt.length), 1)
  const out: number[] = []
  for (let k = 0; k < steps; k++) {
    out.push(argmax(lastLogits(o)))
    o = await runner.step(seqId, { kind: 'tokens', ids: BigInt64Array.of(BigInt(out.at(-1)!)) }, positions(prompt.length + k, 1), 1)
  }
  await runner.drop(seqId, 'free')
  return out
}
