/**
 * gossip.ts names gossipsub's verdicts by value so that loading it does not load gossipsub; these
 * must stay the enum's values, or every gossiped record would be judged by a verdict gossipsub
 * does not know.
 */
import { TopicValidatorResult } from '@libp2p/gossipsub'
import { describe, expect, it } from 'vitest'
import { VERDICTS } from '../../daemon/mesh/gossip.ts'

describe('gossip verdicts', () => {
  it('are gossipsub TopicValidatorResult values', () => {
    expect(VERDICTS).toEqual({ Accept: TopicValidatorResult.Accept, Ignore: TopicValidatorResult.Ignore, Reject: TopicValidatorResult.Reject })
  })
})
