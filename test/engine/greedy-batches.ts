/**
 * Greedy decoding through a batching stage engine (its worker), a sequence alone and several in
 * one batch a step: what the batch-invariance tests compare.
 */
import { GREEDY_PICK as GREEDY } from '../../daemon/engine/index.ts'
import type { BatchingStageEngine, StepOutput } from '../../daemon/engine/index.ts'

export const tokenOf = (out: StepOutput): number => {
  if (out.kind !== 'token') throw new Error(`expected a token, got ${out.kind}`)
  return out.id
}

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
