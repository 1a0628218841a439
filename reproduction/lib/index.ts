/** What the benchmark scripts share: summaries, deterministic prompts, the machine's load line. */
export { floorRank, lowerMedian, median, nearestRank, upperMedian, upperMedianBy } from './stats.ts'
export { lcgTokens, promptIds, raggedPromptIds, streamPromptIds } from './prompts.ts'
export { formatLoad, loadAverage } from './machine.ts'
