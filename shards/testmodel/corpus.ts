/** A small built-in English text the test tokenizers learn their merges from. */
export const CORPUS = `The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest.
Once upon a time there was a little town by the sea. In the town there lived a baker, a teacher and a fisherman.
Every morning the baker made bread, the teacher walked to the school, and the fisherman went out on his boat.
The children of the town liked to play on the beach. They built castles in the sand and watched the waves come in.
One day a storm came over the sea. The wind was strong and the rain fell for three days and three nights.
The fisherman could not go out, so he stayed at home and mended his nets. The baker made more bread than ever,
because everyone in the town wanted to stay inside and eat warm bread with butter and honey.
When the storm was over, the people came out of their houses and looked at the sky. It was blue and clear again.
The teacher told the children a story about the sun and the moon, and how they take turns to watch over the world.
A computer is a machine that can follow a list of instructions. We call such a list a program.
Programs are written by people in languages that the computer can understand, like Python, JavaScript or C.
A network connects many computers so that they can share information with each other.
When you send a message to a friend, it travels through many machines before it reaches the other side.
Each machine only knows where to pass the message next, and together they deliver it to the right place.
Learning a new skill takes time and practice. At first everything seems hard, but every day it becomes a little easier.
Reading books, asking questions and trying things on your own are good ways to learn.
What is the capital of France? The capital of France is Paris. What is two plus two? Two plus two is four.
How are you today? I am fine, thank you. Would you like a cup of tea or a cup of coffee? I would like some tea, please.
The weather today is sunny with a few clouds in the afternoon, and the temperature will be around twenty degrees.
In the summer the days are long and warm; in the winter they are short and cold, and sometimes there is snow.
She opened the window and listened to the birds singing in the garden. The flowers were red, yellow and white.
He said that he would come back tomorrow, but nobody knew what time he would arrive or where he had gone.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in many texts, and so do words such as first, second and third.
`
