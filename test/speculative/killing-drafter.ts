/**
 * Prompt lookup that runs `act` (kills a stage) right after its `at`-th proposal, so the verify
 * that proposal starts meets a dead stage; it always proposes at least one token (the last one
 * again) so that every round is a verify. `proposals()`: how many it made.
 */
import { createPromptLookupDrafter } from '../../daemon/speculative/index.ts'
import type { Drafter } from '../../daemon/speculative/index.ts'

export function killingDrafter (at: number, act: () => Promise<void>): Drafter & { proposals: () => number } {
  const inner = createPromptLookupDrafter()
  let proposals = 0
  return {
    name: 'killing',
    proposals: () => proposals,
    async open (seqId, promptIds, signal) {
      const d = await inner.open(seqId, promptIds, signal)
      return {
        async propose (r) {
          const p = await d.propose(r)
          if (++proposals === at) await act()
          return { tokens: p.tokens.length > 0 ? p.tokens : [r.context[r.context.length - 1]!] }
        },
        close: d.close,
      }
    },
  }
}
